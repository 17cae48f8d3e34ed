"""Files dspark writes and reads.

Writes are atomic: the content goes to a temporary file beside the destination, is fsynced, then renamed
over it, so a crash leaves the old file or the new one, never half of one. Reads of JSON and safetensors
raise `FileReadError` (a ValueError) naming the file and what is wrong. Weights are read from safetensors
only; nothing dspark loads is ever unpickled.
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
NO_PICKLE = "dspark reads weights from safetensors only and never unpickles a file"


class FileReadError(ValueError):
    """A file dspark reads is missing, truncated, corrupt or of the wrong format."""


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside `path` to write; when the block ends, the file is fsynced and
    renamed over `path`; when it raises, the temporary file is deleted and `path` is left as it was."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary files
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with suppress(FileNotFoundError):
            tmp.unlink()
        raise
    with suppress(OSError):  # make the rename itself durable where the platform allows
        dir_fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def remove_stale_temps(path: str | Path) -> None:
    """Delete the temporary files of `path` that writers killed mid-write (SIGKILL, power loss) left."""
    out = Path(path)
    for stale in out.parent.glob(f".{out.name}.*.tmp"):
        with suppress(FileNotFoundError):
            stale.unlink()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    with atomic_path(path) as tmp:
        _write_file(tmp, data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`write_bytes_atomic` of UTF-8 text."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def save_safetensors_atomic(path: str | Path, tensors: dict[str, torch.Tensor],
                            metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (contiguous) to the safetensors file `path` atomically."""
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def save_figure_atomic(fig, path: str | Path, dpi: int = 110) -> Path:
    """`fig.savefig` to `path` atomically, in the format its suffix names (PNG when it has none)."""
    out = Path(path)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=dpi, format=out.suffix.lstrip(".") or "png")
    return out


def read_json(path: str | Path, what: str) -> Any:
    """Parse the JSON file at `path`; a missing, unreadable, non-UTF-8 or malformed file raises
    FileReadError naming `what` ("calibration file", "step profile", ...), the file and the problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileReadError(f"{what} {p} does not exist") from None
    except UnicodeDecodeError as err:
        raise FileReadError(f"{what} {p} is not UTF-8 text (corrupt?): {err}") from None
    except OSError as err:
        raise FileReadError(f"{what} {p} cannot be read: {err.strerror or err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileReadError(f"{what} {p} is not valid JSON (truncated or malformed): {err}") from None


def read_json_lines(path: str | Path, what: str) -> list[tuple[str, Any]]:
    """(line, row) for every non-blank line of a JSON-lines file that is appended to as it goes (a training
    log, a step log). A last line cut short (no newline: the writer was killed mid-line) is left out; any
    other line that is not JSON raises FileReadError naming `what`, the file and the line. A `.gz` file is read
    decompressed (logs kept under benchmarks/results/ are gzipped)."""
    p = Path(path)
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        text = p.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if number == len(lines) and not line.endswith("\n"):
                break  # the line being written when the writer died
            raise FileReadError(f"{what} {p} line {number} is not valid JSON: {err}") from None
    return out


def _looks_pickled(head: bytes) -> bool:
    """Whether a file starting with `head` is a pickle (protocol 2+) or torch.save's zip archive rather than
    safetensors, whose 8-byte header length is followed by its JSON header's "{"."""
    pickle = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and head[8:9] != b"{"
    return pickle or head.startswith(b"PK\x03\x04")


def _safetensors_problem(p: Path, what: str, err: Exception) -> FileReadError:
    """The FileReadError for a safetensors file that failed to open; pickles are called by their name."""
    if not p.exists():
        return FileReadError(f"{what} {p} does not exist")
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError as os_err:
        return FileReadError(f"{what} {p} cannot be read: {os_err.strerror or os_err}")
    if _looks_pickled(head):
        return FileReadError(f"{what} {p} is a pickle (torch.save) file, not safetensors: {NO_PICKLE}; "
                             "convert it with safetensors.torch.save_file")
    return FileReadError(f"{what} {p} is not a readable safetensors file (truncated or corrupt): {err}")


def pickle_files(folder: str | Path) -> list[str]:
    """Names of the files in `folder` that hold pickled weights by their suffix (.bin, .pt, ...)."""
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []


def open_safetensors(path: str | Path, what: str):
    """`safetensors.safe_open` of `path` (framework "pt"); a missing, truncated or non-safetensors file
    raises FileReadError naming `what`, the file and the problem."""
    p = Path(path)
    try:
        return safe_open(str(p), framework="pt")
    except (SafetensorError, OSError) as err:
        raise _safetensors_problem(p, what, err) from None


def load_safetensors(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on the CPU, metadata) of the safetensors file `path`; errors as in `open_safetensors`."""
    with open_safetensors(path, what) as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
