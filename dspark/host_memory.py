"""How the process's C allocator hands large blocks back (glibc on Linux): kept for the next step, not unmapped.

torch's CPU tensors come from the C allocator. glibc serves a request above its mmap threshold (128 KiB at start,
raised as large blocks are freed, at most 32 MiB) with a fresh `mmap` and unmaps it on free, and it trims the
heap's free top once that passes twice the threshold. Either way the next step's large temporaries (the target's
logits at 64 rows drafting 7 slots: [64, 8, 8192] float32, 16 MiB; the block's q and its float64 cumulative sums)
land on fresh pages the kernel must fault in and zero. Measured in process on this machine's CPU (one thread,
20 steps at temperature 1): 14,346 minor page faults a step at 64 rows drafting 7 slots (about 56 MiB of fresh
pages), 4,101 at 16 rows; steps 179-186 ms against 157-165 ms once freed blocks are kept (1,097 faults a step:
blocks over 32 MiB are still mapped afresh). Three-slot blocks and plain steps fault a few dozen times a step and
do not change.

`retain_freed_memory` sets the mmap threshold to its largest value (32 MiB) and the trim threshold to 1 GiB, so
freed blocks stay in the heap for the next step's tensors, and makes every thread allocate from the main heap (one
arena). `dspark serve` steps the engine in a thread of its own, and a thread's own arena gives its heaps back on
terms of its own: with the two thresholds alone a thread still took 12,159 faults a step at 64 rows and 7 slots;
with one arena 1,226-1,425, and 165 against 185 ms a step. The server's threads (the HTTP event loop, the engine)
then share one heap's lock, taken far less often than a step's tensors are computed. The process keeps up to its
peak of freed memory instead of returning it at once, as a server that preallocates its buffers does.

Every `dspark` command calls it before starting a thread; `DSPARK_RETAIN_FREED_MEMORY=0` in the environment (or
`dspark serve --no-retain-freed-memory`) leaves the allocator as it is, for comparisons.
"""
from __future__ import annotations

import ctypes
import os
import platform

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
#: the largest mmap threshold glibc accepts on a 64-bit machine (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 << 20
#: free memory the heap may keep at its top before giving it back
TRIM_THRESHOLD = 1 << 30
#: the environment variable that turns it off ("0")
ENV = "DSPARK_RETAIN_FREED_MEMORY"

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Keep freed large blocks in the heap (see the module docstring); True when the allocator took the settings,
    False where it is not glibc's or `DSPARK_RETAIN_FREED_MEMORY=0` says not to. Idempotent."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1").strip() == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # one arena before any thread allocates; then the mmap threshold (setting either threshold stops glibc from
    # moving both with the blocks it frees)
    _applied = all(libc.mallopt(param, value) == 1 for param, value in
                   ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return _applied


def retaining() -> bool | None:
    """Whether `retain_freed_memory` applied its settings in this process (None: not called yet)."""
    return _applied
