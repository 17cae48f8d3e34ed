"""Files dspark writes and reads: atomic writes (a crash leaves the old file or the new one, never half of
one) and JSON reads whose errors name the file and what is wrong."""
from __future__ import annotations

import json
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


def read_json(path: str | Path, what: str):
    """Parse the JSON file at `path`; a missing, unreadable, non-UTF-8 or malformed file raises ValueError
    naming `what` ("calibration file", "step profile", ...), the file and the problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {p} does not exist") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {p} is not UTF-8 text (corrupt?): {err}") from None
    except OSError as err:
        raise ValueError(f"{what} {p} cannot be read: {err.strerror or err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {p} is not valid JSON (truncated or malformed): {err}") from None
