"""How well do requests draft after the drafter joins them late (`Drafter.join_late`)? (in process)

    python benchmarks/late_join.py [--temperature 0] [--requests 12] [--join-after 40] [--max-tokens 200]
        [--out FILE]

A drafter that sleeps through a long back-off drops every request's context of target features; when it
wakes, the requests still running get a context that starts there and holds only what they decode from
then on. Two engines serve the same requests with fixed K = 7; after `--join-after` steps one of them drops
its drafter's rows and joins every running request late (as the engine does at a wake), the other keeps
them. Reported: drafts accepted per drafted round, by how many output tokens after the join the round
starts, for both (at temperature 0 both decode the same text, so the windows hold the same tokens).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dspark.api import encode_prompt, load_drafter, load_target
from dspark.engine import Engine, EngineConfig, Request
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams

WINDOWS = (0, 10, 20, 40, 80, 160)


def serve(prompts: list[list[int]], args: argparse.Namespace, late: bool) -> dict[int, list[int]]:
    """Drafts accepted per drafted round, keyed by the window of output tokens since the join it starts in."""
    target = load_target()
    engine = Engine(target, load_drafter("dspark", target), "fixed:7", None, EngineConfig(),
                    eos_token_ids=frozenset())
    requests = [Request(p, SamplingParams(args.temperature, seed=i), max_tokens=args.max_tokens)
                for i, p in enumerate(prompts)]
    for r in requests:
        engine.add(r)
    for _ in range(args.join_after):
        engine.step()
    joined = {r.seq: len(r.output_ids) for r in engine.running}
    if late:  # what a wake does: the drafter holds no rows, every running request joins it late
        engine.drafter.reset()
        engine._blind.update(joined)
        engine._join_late(list(engine.running))
    rounds = {r.seq: len(r.rounds) for r in requests}
    while engine.has_work:
        engine.step()
    out: dict[int, list[int]] = {w: [] for w in WINDOWS}
    for r in requests:
        if r.seq not in joined:
            continue
        position = joined[r.seq]
        for s in r.rounds[rounds[r.seq]:]:
            if s.draft_len > 0:
                out[max(w for w in WINDOWS if w <= position - joined[r.seq])].append(s.accepted)
            position += s.accepted + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--join-after", type=int, default=40, help="engine steps before the late join")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_target()
    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 40)][: args.requests]
    prompts = [encode_prompt(target, t) for t in texts]
    kept, late = serve(prompts, args, False), serve(prompts, args, True)
    lines = [f"python benchmarks/late_join.py {' '.join(sys.argv[1:])}",
             f"{args.requests} requests, temperature {args.temperature:g}, fixed K = 7, join after {args.join_after} "
             f"steps; drafts accepted per drafted round (rounds)",
             f"{'tokens since the join':>22} {'context kept':>16} {'joined late':>16}"]
    for i, w in enumerate(WINDOWS):
        span = f"{w}-{WINDOWS[i + 1] - 1}" if i + 1 < len(WINDOWS) else f"{w}+"
        cells = [f"{statistics.mean(x[w]):.2f} ({len(x[w])})" if x[w] else "-" for x in (kept, late)]
        lines.append(f"{span:>22} {cells[0]:>16} {cells[1]:>16}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
