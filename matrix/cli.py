"""`tandem matrix render|check|print|lint` (also `python -m matrix ...`).

Exit codes: 0 clean; 1 a stale table, a non-canonical glyph, or a supported cell that no test
proves; 2 bad usage or broken markers; 3 a declaration (or a kept config, or a `proves` marker in
tests/) that cannot be read.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path
from typing import Callable

from matrix import evidence, lint
from matrix.docs import DEFAULT_ROOT, Result, display, docs_dir, examine
from matrix.errors import MatrixError, StaleDocs, UsageError
from matrix.files import read_text, write_atomic
from matrix.targets import IDS, target
from runtime.options import plural

Command = Callable[[argparse.Namespace], int]


def reports_errors(command: Command) -> Command:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except MatrixError as err:
            print(f"matrix: error: {err}", file=sys.stderr)
            return err.exit_code

    return run


def fix_command(root: Path, verb: str = "render") -> str:
    where = "" if root.resolve() == DEFAULT_ROOT else f" --root {shlex.quote(str(root))}"
    return f"tandem matrix {verb}{where}"


@reports_errors
def run_render(args: argparse.Namespace) -> int:
    results = examine(args.root)
    for result in results:
        if result.changed:
            write_atomic(result.doc.path, result.expected)
            print(f"wrote {result.doc.display}")
    if not any(result.changed for result in results):
        print("docs are up to date")
    return 0


def summary(results: list[Result]) -> tuple[int, int, int]:
    changed = [r for r in results if r.changed]
    return len(changed), sum(len(r.stale) for r in results), sum(len(r.findings) for r in results)


@reports_errors
def run_check(args: argparse.Namespace) -> int:
    results = examine(args.root)
    proofs = evidence.examine(args.root)
    files, stale, glyphs = summary(results)
    for result in results:
        if result.changed:
            print(result.diff(), end="")
        for finding in result.findings:
            print(finding.format())
        for region_id in result.stale:
            print(f"{result.doc.display}: generated region {region_id!r} is stale")
    for failure in proofs.failures:
        print(failure)
    if files:
        print(f"{plural(stale, 'stale region')} and {plural(glyphs, 'non-canonical glyph')} in "
              f"{plural(files, 'file')}; "
              f"run `{fix_command(args.root)}`")
    if proofs.failures:
        print(f"{plural(len(proofs.failures), 'supported or partial cell')} with no proving test; "
              "see docs/contributing.md")
    if not files and not proofs.failures:
        pictures = sum(not r.doc.display.endswith(".md") for r in results)
        print(f"docs are up to date: {len(IDS)} generated regions, {len(results) - pictures} markdown files and "
              f"{pictures} diagrams checked; "
              f"{proofs.num_proven} supported or partial cells proven by {proofs.num_tests} tests")
    for warning in proofs.warnings:
        print(warning)
    return StaleDocs.exit_code if files or proofs.failures else 0


@reports_errors
def run_print(args: argparse.Namespace) -> int:
    docs_dir(args.root)
    print(target(args.id).render(args.root), end="")
    return 0


def markdown_files(paths: list[Path], root: Path) -> list[Path]:
    if not paths:
        return sorted(docs_dir(root).rglob("*.md"))
    files = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(path.rglob("*.md")))
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such file or directory")
    return files


@reports_errors
def run_lint(args: argparse.Namespace) -> int:
    total = 0
    for path in markdown_files(args.paths, args.root):
        shown = display(path, args.root)
        text = read_text(path, shown)
        findings = lint.findings_in(text, shown)
        total += len(findings)
        for finding in findings:
            print(finding.format())
        if findings and args.fix:
            write_atomic(path, lint.fix(text))
            print(f"fixed {plural(len(findings), 'glyph')} in {shown}")
    if total and not args.fix:
        paths = "".join(f" {shlex.quote(str(path))}" for path in args.paths)
        print(f"{plural(total, 'non-canonical glyph')}; run `{fix_command(args.root, 'lint --fix')}{paths}`")
        return StaleDocs.exit_code
    return 0


def add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="matrix_command", metavar="COMMAND", required=True, help="what to do")
    root = argparse.ArgumentParser(add_help=False)
    root.add_argument(
        "--root", type=Path, default=DEFAULT_ROOT, help="repository root holding docs/ (default: this checkout)"
    )
    commands.add_parser("render", parents=[root], help="write every generated region and fix glyphs") \
        .set_defaults(run=run_render)
    commands.add_parser(
        "check", parents=[root], help="exit 1 if a region is stale, a glyph is not canonical or a cell is unproven"
    ).set_defaults(run=run_check)
    printer = commands.add_parser("print", parents=[root], help="print one region's fresh body")
    printer.add_argument("id", help=f"one of: {', '.join(IDS)}")
    printer.set_defaults(run=run_print)
    linter = commands.add_parser("lint", parents=[root], help="report non-canonical glyphs in markdown files")
    linter.add_argument("paths", nargs="*", type=Path, help="files or directories (default: docs/)")
    linter.add_argument("--fix", action="store_true", help="rewrite the files with canonical glyphs")
    linter.set_defaults(run=run_lint)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Mounts the commands as `tandem matrix ...`."""
    from runtime.cli import examples

    add_commands(subparsers.add_parser(
        "matrix", help="render and check the generated support tables in docs/",
        description="Render and check what docs/ generates from the model declarations: the support tables, "
                    "the `tandem plan` examples and the page-pool diagrams. `check` exits 1 when one is stale, a "
                    "status glyph is not canonical, or a supported cell has no test that proves it.",
        epilog=examples("tandem matrix render", "tandem matrix check", "tandem matrix print supported-models",
                        "tandem matrix lint --fix docs/")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix", description=__doc__.splitlines()[0])
    add_commands(parser)
    args = parser.parse_args(argv)
    return args.run(args)
