"""`tandem`: the command line. Each subcommand module adds its own parser.

Conventions (vLLM's and git's): `--version`; every `--help` has a description and examples;
every user error is one line on stderr and exit status 2; Ctrl-C exits 130 and a closed pipe
exits quietly, both without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version

from runtime.options import spelled_as_flags

# Subcommands are imported only when named, so that `tandem plan` never imports torch.
SUBCOMMANDS = {
    "generate": "runtime.generate",
    "chat": "runtime.chat",
    "plan": "runtime.plan",
    "serve": "runtime.serve",
    "matrix": "matrix.cli",
}
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


class TandemParser(argparse.ArgumentParser):
    """Descriptions wrapped, examples kept as written, and a usage error in one line."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        if kwargs.get("description"):
            kwargs["description"] = textwrap.fill(kwargs["description"], 100)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = TandemParser(
        prog="tandem",
        description="A runtime for hybrid attention/Mamba language models.",
        epilog=examples('tandem generate "The page pool"', "tandem chat runtime/default_model",
                        "tandem plan docs/configs/ibm-ai-platform__Bamba-9B", "tandem serve path/to/model",
                        "tandem COMMAND --help"),
    )
    parser.add_argument("--version", action="version", version=f"tandem {tandem_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=TandemParser,
                                       help="what to do; `tandem COMMAND --help` says more")
    for name, module in SUBCOMMANDS.items():
        if only in (None, name):
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=f"see `tandem {name} --help`")
    for subparser in subparsers.choices.values():
        subparser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def examples(*commands: str) -> str:
    """The epilog of a --help: one example per line, as written."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if a in SUBCOMMANDS), None)
    try:
        parser = build_parser(only=named)
        args = parse(parser, argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(message)s")
        try:
            with spelled_as_flags(getattr(args, "option_flags", None)):
                code = args.run(args)
            sys.stdout.flush()
            return code
        except ValueError as err:
            # Every user error is a ValueError whose message names the problem and the fix.
            print(f"tandem {args.command}: error: {err}", file=sys.stderr)
            return EXIT_USAGE
    except KeyboardInterrupt:
        # What was printed stays printed; the line is ended so the shell prompt starts clean.
        _quiet_flush()
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (`| head`) went away: nothing more to say. Point stdout at /dev/null so the
        # interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an unknown option is reported by its subcommand, whose --help lists the options."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _quiet_flush() -> None:
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
