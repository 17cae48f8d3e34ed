"""Argument checks shared by the Python API and the `dspark` command line.

A bad value fails naming the argument and the accepted range: `check_int`, `check_real`, `check_text` and
`resolve_device` raise ValueError (the Python API); `int_arg`, `real_arg`, `device_arg`, `drafter_arg`,
`scheduler_arg`, `domain_arg` and `existing_path_arg` are argparse types (the command line: "dspark generate:
error: argument --top-p: must be a finite number in (0, 1], got 2.0"), and `Parser` prints such an error as
one line instead of the usage and a line.
"""
from __future__ import annotations

import argparse
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

import torch


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _interval(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_num(high)}"
    return ""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def int_problem(value: Any, low: int | None = None, high: int | None = None) -> str | None:
    """None when `value` is an integer (not a bool) in [low, high]; else what it must be."""
    bound = _interval(low, high)
    need = f"must be an integer{' ' + bound if bound else ''}, got {_shown(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return need
    if (low is not None and value < low) or (high is not None and value > high):
        return need
    return None


def real_problem(value: Any, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False) -> str | None:
    """None when `value` is a finite real number in the interval; else what it must be."""
    bound = _interval(low, high, low_open, high_open)
    need = f"must be a finite number{' ' + bound if bound else ''}, got {_shown(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return need
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float is out of every finite interval
        return need
    if not math.isfinite(number):
        return need
    if low is not None and (number <= low if low_open else number < low):
        return need
    if high is not None and (number >= high if high_open else number > high):
        return need
    return None


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int; ValueError "NAME must be an integer in [low, high], got VALUE" otherwise."""
    problem = int_problem(value, low, high)
    if problem:
        raise ValueError(f"{name} {problem}")
    return int(value)


def check_real(name: str, value: Any, low: float | None = None, high: float | None = None, low_open: bool = False,
               high_open: bool = False) -> float:
    """`value` as a float; ValueError naming `name` and the interval unless it is a finite number in it."""
    problem = real_problem(value, low, high, low_open, high_open)
    if problem:
        raise ValueError(f"{name} {problem}")
    return float(value)


def check_text(name: str, value: Any) -> str:
    """`value` if it is a non-empty str of valid Unicode (no lone surrogates); ValueError naming `name` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_shown(value)}")
    if not value:
        raise ValueError(f"{name} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate {value[err.start]!r} at character "
                         f"{err.start}") from None
    return value


def resolve_device(device: Any, name: str = "device") -> torch.device:
    """The torch device `device` names; ValueError naming `name` when it is unknown or not on this machine."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a torch device such as cpu, cuda, cuda:N or mps, got {_shown(device)}") \
            from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{name} {str(dev)!r} is not available: this torch sees no CUDA device "
                             f"(torch {torch.__version__}); use cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{name} {str(dev)!r} is not available: CUDA devices are cuda:0 to cuda:{count - 1}")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"{name} 'mps' is not available on this machine; use cpu")
    return dev


# ---------------------------------------------------------------------- argparse types
def _argtype(check: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def int_arg(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = text
        problem = int_problem(value, low, high)
        if problem:
            raise ValueError(problem)
        return value

    return _argtype(check, "integer")


def real_arg(low: float | None = None, high: float | None = None, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in the interval."""
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = text
        problem = real_problem(value, low, high, low_open, high_open)
        if problem:
            raise ValueError(problem)
        return value

    return _argtype(check, "number")


def _device(text: str) -> str:
    resolve_device(text, "the device")
    return text


def _drafter(text: str) -> str:
    from dspark.api import DRAFTER_NAMES

    if text in DRAFTER_NAMES or Path(text).is_dir():
        return text
    raise ValueError(f"unknown drafter {text!r}: choose one of {', '.join(DRAFTER_NAMES)} or the folder of a "
                     f"drafter checkpoint")


def _scheduler(text: str) -> str:
    from dspark.scheduling import parse_policy

    parse_policy(text, 1 << 20)  # the name and the value's form; K against the drafter's block once it is loaded
    return text


def _domain(text: str) -> str:
    from dspark.zoo import eval_prompts_path

    if eval_prompts_path(text).exists():
        return text
    folder = eval_prompts_path(text).parent
    known = sorted(p.stem for p in folder.glob("*.jsonl"))
    raise ValueError(f"unknown domain {text!r}: choose from {', '.join(known) or f'the prompt files in {folder}'}")


def _existing(text: str) -> str:
    if Path(text).exists():
        return text
    raise ValueError(f"no such file or folder: {text}")


def _label(text: str) -> str:
    check_text("the label", text)
    if len(text) > 64:
        raise ValueError(f"labels are at most 64 characters, got {len(text)}")
    return text


def check_domain(text: str) -> str:
    """`text` if bundled evaluation prompts exist for it; ValueError listing the known domains otherwise."""
    return _domain(text)


device_arg = _argtype(_device, "device")
label_arg = _argtype(_label, "label")
existing_path_arg = _argtype(_existing, "path")
drafter_arg = _argtype(_drafter, "drafter")
scheduler_arg = _argtype(_scheduler, "scheduler")
domain_arg = _argtype(_domain, "domain")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: "PROG: error: MESSAGE (see PROG --help)", exit status 2."""

    def error(self, message: str):
        """Print the one-line error and exit 2."""
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def serving_threads(device: str, threads: int | None) -> int | None:
    """Torch intra-op threads for `dspark serve`: `threads` if given; on a CPU device, one fewer than torch's
    default (one per core), at least 1; None elsewhere (torch's default).

    A server's event loop (HTTP, SSE, detokenizing) shares the CPU with the engine thread, and a parallel region
    whose worker is descheduled waits for it: on 2 cores with the load generator beside it, 1 intra-op thread
    served 1.12-1.24x the output tokens/s of 2 at 4 and 16 clients, temperature 1, with and without drafting
    (means of 2 repeats, `benchmarks/results/serving/threads/`)."""
    if threads is not None:
        return int(threads)
    if str(device).startswith("cpu"):
        import torch

        return max(1, torch.get_num_threads() - 1)
    return None
