"""Inverse-CDF draws in one level (a float64 cumulative sum of every row) against two (block sums, then one block).

    python benchmarks/inverse_cdf_levels.py

One torch thread, the same probabilities and uniforms for both, interleaved, best of three runs of 20-200 calls;
with freed memory kept for reuse (`dspark.host_memory`, as every `dspark` command runs) unless
DSPARK_RETAIN_FREED_MEMORY=0. Also checks that both draw the same tokens.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.host_memory import retain_freed_memory  # noqa: E402
from dspark.sampling import _one_level as one_level, _two_level  # noqa: E402


def per_call_ms(fn, probs: torch.Tensor, u: torch.Tensor, calls: int) -> float:
    for _ in range(3):
        fn(probs, u)
    start = time.perf_counter()
    for _ in range(calls):
        fn(probs, u)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> int:
    torch.set_num_threads(1)
    kept = retain_freed_memory()
    print(f"freed memory kept: {kept}; ms a call (best of 3), one level / two levels")
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 8192), (16, 8192), (32, 8192), (64, 8192), (8, 151936), (64, 151936)):
        probs = torch.softmax(3 * torch.randn(rows, vocab, generator=gen), -1)
        u = torch.rand(rows, generator=gen, dtype=torch.float64)
        assert torch.equal(one_level(probs, u), _two_level(probs, u))
        calls = 20 if vocab > 10_000 else 200
        times = [(per_call_ms(one_level, probs, u, calls), per_call_ms(_two_level, probs, u, calls)) for _ in range(3)]
        print(f"{rows:3d} rows × {vocab:6d}: {min(a for a, _ in times):7.3f} / {min(b for _, b in times):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
