"""`dspark.host_memory`: freed large blocks are kept for the next step instead of faulting in fresh pages."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")

# A step's worth of large temporaries whose sizes change from step to step, as a decoding step's do (the target's
# logits at 64 rows and 6-8 query tokens, the block's q, its float64 cumulative sums, an activation), all alive
# together: the minor page faults a step costs in each of 5 blocks of 20 steps, after three warm-up steps.
# argv: where the steps run (main / thread) and the settings (retain: `retain_freed_memory` as every command calls
# it; thresholds: the two thresholds without the single arena; none).
STEPS = """
import ctypes, resource, sys, threading, torch
from dspark import host_memory
if sys.argv[2] == "retain":
    assert host_memory.retain_freed_memory()
elif sys.argv[2] == "thresholds":
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_THRESHOLD)
    libc.mallopt(host_memory.M_TRIM_THRESHOLD, host_memory.TRIM_THRESHOLD)
def step(i):
    logits = torch.ones(64, 8 - i % 3, 8192)
    q = torch.softmax(logits[:, :6], -1)
    cdf = q.double().cumsum(-1)
    h = torch.ones(512, 320 * (1 + i % 2))
    out = float(cdf[..., -1].sum() + h.sum() + logits.sum())
    del q, cdf, h, logits
    return out
def run(out):
    for i in range(3):
        step(i)
    for b in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(20):
            step(20 * b + i)
        out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
out = []
if sys.argv[1] == "thread":  # as `dspark serve` steps its engine
    worker = threading.Thread(target=run, args=(out,))
    worker.start()
    worker.join()
else:
    run(out)
print(sorted(out)[2])  # the median block: a one-off growth of the heap left out
"""


def faults_per_step(where: str, settings: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_RETAIN_FREED_MEMORY"}
    out = subprocess.run([sys.executable, "-c", STEPS, where, settings], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return float(out.stdout.split()[-1])


def test_kept_blocks_spare_a_steps_page_faults_in_the_main_thread_and_in_the_engines_thread():
    # measured: about 16,600 a step as glibc comes, none once kept
    default, kept = faults_per_step("main", "none"), faults_per_step("main", "retain")
    assert default > 1_000 and kept < default / 10, (kept, default)
    # in a thread of its own (as `dspark serve` steps its engine), the two thresholds alone put the blocks in the
    # thread's own heaps, which glibc unmaps once they are free (measured: 6,800-10,100 a step); one arena keeps them
    thresholds, kept = faults_per_step("thread", "thresholds"), faults_per_step("thread", "retain")
    assert thresholds > 1_000 and kept < thresholds / 10, (kept, thresholds)


def test_retain_freed_memory_is_idempotent_and_reported(monkeypatch):
    from dspark import host_memory

    monkeypatch.setattr(host_memory, "_applied", None)
    assert host_memory.retaining() is None
    first = host_memory.retain_freed_memory()
    assert first is True and host_memory.retaining() is True and host_memory.retain_freed_memory() is True


def test_the_environment_variable_leaves_the_allocator_alone(monkeypatch):
    from dspark import host_memory

    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("DSPARK_RETAIN_FREED_MEMORY", "0")
    assert host_memory.retain_freed_memory() is False and host_memory.retaining() is False
