"""Reading docs as exact text, and writing files atomically (never half-written)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from matrix.errors import UsageError


def read_text(path: Path, display: str) -> str:
    """The file's exact text: strict UTF-8, line endings and any BOM kept (the linter reports a BOM)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{display}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory and os.replace, keeping the file's mode."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(text.encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
