"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""
from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it over `path`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; these are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return out


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`write_bytes_atomic` of UTF-8 text."""
    return write_bytes_atomic(path, text.encode("utf-8"))
