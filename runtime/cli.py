"""`tandem`: the command line. Each subcommand module adds its own parser."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommands are imported only when named, so that `tandem plan` never imports torch.
SUBCOMMANDS = {
    "generate": "runtime.generate",
    "plan": "runtime.plan",
    "serve": "runtime.serve",
    "matrix": "matrix.cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="A runtime for hybrid attention/Mamba language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        if only in (None, name):
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=f"see `tandem {name} --help`")
    for subparser in subparsers.choices.values():
        subparser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(only=named)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.run(args)
    except ValueError as err:
        # Every user error is a ValueError whose message names the problem and the fix.
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
