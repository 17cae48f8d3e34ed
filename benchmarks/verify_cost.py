"""What verification and the drafts' finiteness check cost per step, on synthetic blocks of the bundled size.

    python benchmarks/verify_cost.py [--rows 16] [--drafts 4] [--vocab 8192] [--temperature 1] [--repeats 200]
        [--logits-dtype bfloat16] [--greedy-rows 0]

Times `dspark.verify.verify` on target logits [rows, drafts + 1, vocab] in `--logits-dtype` (bfloat16 by default;
the engine's verify passes hand it float32 logits) with draft distributions [rows, drafts, vocab], every row
sampled at the temperature (0: greedy) but the first `--greedy-rows`, which are greedy, and the engine's check
that a block's probabilities and confidences are finite (`Engine._drop_nonfinite`), each the median of
`--repeats` calls on one torch thread, with freed memory kept for reuse as `dspark` commands run. Run it on two checkouts (PYTHONPATH=OTHER/ python ...) to compare
versions: the figures are the code's own, on this machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from dspark.drafters.base import DraftBlock
from dspark.engine.engine import Engine
from dspark.host_memory import retain_freed_memory
from dspark.sampling import BatchSampling, SamplingParams
from dspark.verify import verify


def median_ms(call, repeats: int) -> float:
    """Median wall time of `call()` in milliseconds over `repeats` calls, after two warm-up calls."""
    call(), call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--logits-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--greedy-rows", type=int, default=0, help="rows that decode greedily (a mixed batch)")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    g = torch.Generator().manual_seed(0)
    rows, drafts, vocab = args.rows, args.drafts, args.vocab
    logits = torch.randn(rows, drafts + 1, vocab, generator=g).to(getattr(torch, args.logits_dtype))
    probs = torch.softmax(2 * torch.randn(rows, drafts, vocab, generator=g), -1)
    tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=g).view(rows, drafts)
    lengths = torch.full((rows,), drafts, dtype=torch.long)
    greedy = min(rows, args.greedy_rows)
    sampling = BatchSampling.from_params([SamplingParams()] * greedy
                                         + [SamplingParams(temperature=args.temperature)] * (rows - greedy), "cpu")
    generators = [torch.Generator().manual_seed(r) for r in range(rows)]
    block = DraftBlock(tokens, lengths, probs, torch.rand(rows, drafts, generator=g))
    owner = SimpleNamespace(nonfinite_drafts=0)
    verify_ms = median_ms(lambda: verify(logits, tokens, lengths, probs, sampling, generators), args.repeats)
    check_ms = median_ms(lambda: Engine._drop_nonfinite(owner, block), args.repeats)
    print(f"python benchmarks/verify_cost.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{rows} rows ({greedy} greedy), {drafts} drafts, vocabulary {vocab}, temperature {args.temperature:g}, "
          f"{args.logits_dtype} logits, one thread: "
          f"verify {verify_ms:.3f} ms, finiteness check {check_ms:.3f} ms (medians of {args.repeats})")
    return 0


if __name__ == "__main__":
    retain_freed_memory()  # as every `dspark` command runs: freed blocks are reused, not faulted in afresh
    sys.exit(main())
