"""Failures of the matrix tooling, each carrying the exit code its command returns."""

from __future__ import annotations

from typing import ClassVar


class MatrixError(Exception):
    """Base class; the message names the problem and how to fix it."""

    exit_code: ClassVar[int] = 2


class StaleDocs(MatrixError):
    """A generated region differs from what the declarations render, or a glyph is not canonical."""

    exit_code = 1


class UsageError(MatrixError):
    """Bad command-line usage: an unknown id, a missing docs directory, a file that is not UTF-8."""

    exit_code = 2


class MarkerError(UsageError):
    """Broken BEGIN/END GENERATED markers: missing END, unknown or duplicate id, nesting, an id never found."""


class BadDeclaration(MatrixError):
    """A model declaration (or a published config kept with the docs) cannot be rendered."""

    exit_code = 3


class BadClaim(MatrixError):
    """A `proves` marker in tests/ that cannot be read: an unknown name, a place no test runs it from."""

    exit_code = 3
