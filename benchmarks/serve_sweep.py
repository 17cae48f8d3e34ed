"""Load sweep over HTTP: `dspark serve` per verification scheduler, closed-loop streaming clients at each concurrency.

    python benchmarks/serve_sweep.py [--arms none fixed:7 fixed:3 fixed:1 threshold:0.6 dspark dspark-async]
        [--temperatures 0 1] [--concurrency 1 2 4 8 16 32 64] [--requests-per-client 3] [--max-tokens 64]
        [--length-spread 0] [--ignore-eos] [--repeats 2] [--drafter dspark] [--device cpu|cuda] [--dtype D]
        [--profile FILE] [--out DIR] [--port 8123]

The script starts one `dspark serve --scheduler ARM` per arm (same target, same drafter everywhere, except that
the engine of the `none` arm keeps no drafter, as a server without speculation would; each
its own process and port; an idle server takes no CPU) and then, per repeat, temperature and concurrency,
drives the arms in turn (so drifts of the machine fall on every arm alike; the order reverses every other
repeat, so an arm's place in it does not favour it either) with C clients, each sending
streaming chat completions back to back (a closed loop) over the bundled held-out prompts (code, prose and
math in turn, so every concurrency sees the same mix) with the official `openai` async client (one Python
process, one thread: on 2 cores a multi-process load generator would take the server's CPU;
`benchmarks/aiperf_crosscheck.py` cross-checks one cell against NVIDIA's aiperf). A request ends at the
target's EOS or at its length (--max-tokens, or drawn around it with --length-spread), as a user's would; at
temperature 0 every arm commits the same tokens (lossless), at temperature > 0 the same distribution.
--ignore-eos asks for exactly the length instead (vLLM's `ignore_eos`): the same work in every arm, but past
EOS the target writes text no user reads, on which drafters accept far fewer tokens (the bundled DSpark drafter
at batch 1 on 30 held-out prompts, 128 tokens: 2.69 drafts accepted per round before the first EOS and 0.99
after it at temperature 1; 3.93 and 1.47 at temperature 0; `benchmarks/eos_acceptance.py`), so it
understates what speculation gives users.

Figures per arm and cell (a cell: arm, temperature, concurrency, repeat):
- output tok/s: tokens committed while all C clients were decoding and none had finished its last request
  (the steady window; each request's tokens are spread evenly over its decoding time);
- per-user tok/s: each measured request's decoding speed (tokens − 1) / (last − first token), median and
  p10; TTFT and TPOT p50 / p99;
- τ, verified draft tokens and wasted (verified − accepted) per step, the share of request rounds that verified
  a draft and the drafter's sleeps, from the server's /metrics.
Writes DIR/serve_sweep.json, prints the tables and plots throughput against concurrency and per-user speed
against throughput (the paper's Fig. 7 view) into DIR.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark.evaluation.bench import mixed_eval_prompts

DEFAULT_ARMS = ["none", "fixed:7", "fixed:3", "fixed:1", "threshold:0.6", "dspark", "dspark-async"]
COUNTERS = {
    "generation": "dspark:generation_tokens_total",
    "draft_tokens": "dspark:spec_decode_num_draft_tokens_total",
    "accepted": "dspark:spec_decode_num_accepted_tokens_total",
    "rounds": "dspark:decode_rounds_total",
    "steps": "dspark:step_time_seconds_count",
    "verifying_rows": "dspark:spec_decode_num_drafts_total",
    "sleeps": "dspark:engine_drafter_sleeps_total",
}


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no data."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def scrape(base: str) -> dict[str, float]:
    """The server's counters of COUNTERS (summed over labels)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {k: 0.0 for k in COUNTERS}
    by_sample = {v: k for k, v in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = by_sample.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


def start_server(arm: str, port: int, args: argparse.Namespace, log: Path,
                 extra: list[str] | None = None) -> subprocess.Popen:
    """Start `dspark serve` for one arm on `port` (does not wait for it); `extra`: more serve options.

    An arm is a scheduler name, optionally followed by serve flags without their dashes after `+`:
    `dspark+rate-guard` serves the dspark scheduler with `--rate-guard`."""
    scheduler, *flags = arm.split("+")
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--scheduler", scheduler, "--drafter", args.drafter,
           "--port", str(port), "--max-running", str(max(args.concurrency)),
           "--device", getattr(args, "device", "cpu"), "--dtype", getattr(args, "dtype", "bfloat16")]
    if args.profile:
        cmd += ["--profile", args.profile]
    cmd += [f"--{flag}" for flag in flags] + (extra or [])
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, base: str, limit: float, log: Path, what: str = "dspark serve") -> None:
    """Wait until the server answers /health (it may profile its steps first); raise naming its log when it
    exits or never answers."""
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{what} did not answer /health in {limit} s; see {log}:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then wait (the server drains and exits)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def request_length(args, seed: int) -> int:
    """Output tokens of the request with this seed: --max-tokens, or with --length-spread s drawn uniformly from
    [(1 - s)·max_tokens, (1 + s)·max_tokens] by the seed, so every arm serves the same lengths."""
    spread = getattr(args, "length_spread", 0.0)
    if not spread:
        return args.max_tokens
    low, high = round((1 - spread) * args.max_tokens), round((1 + spread) * args.max_tokens)
    return random.Random(seed).randint(max(1, low), max(1, high))


async def one_request(client, model: str, prompt: str, args, temperature: float, seed: int) -> dict:
    """One streaming chat completion; returns its start, first-token and end times and token count."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=request_length(args, seed),
        temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if getattr(args, "ignore_eos", False) else None)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"start": start, "first": first or end, "end": end, "tokens": tokens}


async def closed_loop(base: str, model: str, prompts: list[str], concurrency: int, args, temperature: float,
                      repeat: int) -> list[list[dict]]:
    """C clients, each sending requests_per_client requests back to back; per client its request records."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=3600,
                         http_client=None)

    async def worker(w: int) -> list[dict]:
        done = []
        for j in range(args.requests_per_client):
            i = (w * args.requests_per_client + j + repeat * 7) % len(prompts)
            done.append(await one_request(client, model, prompts[i], args, temperature, seed=1000 * w + j))
        return done

    try:
        return await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await client.close()


def cell_figures(clients: list[list[dict]]) -> dict:
    """Steady-window throughput and per-request latency figures of one cell.

    The window runs from the moment every client's first request is decoding (the burst of first prefills
    is over) to the moment the first client finishes its last request (after that fewer than C requests
    are in flight); every request's tokens are spread evenly over its decoding time and counted where they
    fall in the window. Latency figures come from the requests after each client's first (warm-up)."""
    t0 = max(c[0]["first"] for c in clients)
    t1 = min(c[-1]["end"] for c in clients)
    window_tokens = 0.0
    for r in (r for c in clients for r in c):
        span = max(r["end"] - r["first"], 1e-9)
        overlap = max(0.0, min(r["end"], t1) - max(r["first"], t0))
        window_tokens += max(r["tokens"] - 1, 0) * overlap / span  # a request that ended at once adds none
    measured = [r for c in clients for r in c[1:]]
    per_user = [(r["tokens"] - 1) / max(r["end"] - r["first"], 1e-9) for r in measured if r["tokens"] > 1]
    ttft = [r["first"] - r["start"] for r in measured]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in measured if r["tokens"] > 1]
    return {
        "throughput": window_tokens / (t1 - t0) if t1 > t0 else float("nan"),
        "window_s": t1 - t0,
        "requests": len(measured),
        "tokens": sum(r["tokens"] for r in measured),
        "per_user_median": statistics.median(per_user) if per_user else float("nan"),
        "per_user_p10": percentile(per_user, 0.10),
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
    }


def server_figures(before: dict, after: dict) -> dict:
    """τ and per-step verified / wasted draft tokens from the /metrics counters' change over a cell."""
    d = {k: after[k] - before[k] for k in COUNTERS}
    steps = max(d["steps"], 1.0)
    return {
        "tau": d["generation"] / max(d["rounds"], 1.0),
        "verified_per_step": d["draft_tokens"] / steps,
        "wasted_per_step": (d["draft_tokens"] - d["accepted"]) / steps,
        "steps": d["steps"],
        # the share of request rounds that verified at least one draft, and the drafter's sleeps in the cell
        "verifying_share": d["verifying_rows"] / max(d["rounds"], 1.0),
        "drafter_sleeps": d["sleeps"],
    }


def machine() -> dict:
    """CPU model, core count and torch version of this run (profiles and figures depend on them)."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__}


def run(args: argparse.Namespace) -> dict:
    """Every arm's server runs at once (idle ones wait on a condition and take no CPU); the cells go round
    robin over the arms inside each (repeat, temperature, concurrency), so slow drifts of the machine and
    other load fall on every arm alike instead of on whichever arm ran at the time."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = mixed_eval_prompts(args.prompts)  # domains in turn: the same mix at every concurrency
    path = out / "serve_sweep.json"
    results = json.loads(path.read_text()) if path.exists() and args.resume else {"cells": []}
    results["command"] = "python benchmarks/serve_sweep.py " + " ".join(sys.argv[1:])
    results["settings"] = {k: v for k, v in vars(args).items()}
    results["machine"] = machine()
    done = {(c["arm"], c["temperature"], c["concurrency"], c["repeat"]) for c in results["cells"]}
    todo = [(r, t, c, arm) for r in range(args.repeats) for t in args.temperatures for c in args.concurrency
            for arm in (args.arms if r % 2 == 0 else args.arms[::-1]) if (arm, t, c, r) not in done]
    arms = [arm for arm in args.arms if any(a == arm for *_, a in todo)]
    bases = {arm: f"http://127.0.0.1:{args.port + i}" for i, arm in enumerate(arms)}
    logs = {arm: out / f"server_{arm.replace(':', '_')}.log" for arm in arms}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for i, arm in enumerate(arms):  # one at a time: starting (and profiling) in parallel would skew both
            procs[arm] = start_server(arm, args.port + i, args, logs[arm])
            wait_healthy(procs[arm], bases[arm], args.start_timeout, logs[arm], f"dspark serve --scheduler {arm}")
        models = {arm: httpx.get(f"{bases[arm]}/v1/models", timeout=10).json()["data"][0]["id"] for arm in arms}
        for arm in arms:  # warm each server up
            asyncio.run(closed_loop(bases[arm], models[arm], prompts, 2, args, 0.0, 0))
        for rep, temperature, conc, arm in todo:
            base = bases[arm]
            before = scrape(base)
            clients = asyncio.run(closed_loop(base, models[arm], prompts, conc, args, temperature, rep))
            cell = {"arm": arm, "temperature": temperature, "concurrency": conc, "repeat": rep,
                    **cell_figures(clients), **server_figures(before, scrape(base))}
            results["cells"].append(cell)
            print(f"{arm:>14} T={temperature:g} c={conc:>3} r={rep}: {cell['throughput']:7.1f} tok/s, "
                  f"per-user {cell['per_user_median']:6.1f} (p10 {cell['per_user_p10']:6.1f}), "
                  f"TTFT p50 {cell['ttft_p50'] * 1e3:6.0f} ms, τ {cell['tau']:.2f}, "
                  f"verified/step {cell['verified_per_step']:.1f}, rounds verifying drafts {cell['verifying_share']:.2f}, "
                  f"drafter sleeps {cell['drafter_sleeps']:.0f}", flush=True)
            path.write_text(json.dumps(results, indent=1))
    finally:
        for proc in procs.values():
            stop_server(proc)
    return results


def summarize(results: dict) -> str:
    """Per temperature: mean throughput (± half the spread of the repeats) per arm and concurrency."""
    cells = results["cells"]
    lines = []
    for temp in sorted({c["temperature"] for c in cells}):
        concs = sorted({c["concurrency"] for c in cells if c["temperature"] == temp})
        arms = list(dict.fromkeys(c["arm"] for c in cells if c["temperature"] == temp))
        lines.append(f"\nT={temp:g}: output tok/s (mean of repeats ± half their range); per-user tok/s median")
        lines.append(f"{'arm':>14} " + " ".join(f"{'c=' + str(c):>16}" for c in concs))
        for arm in arms:
            row = []
            for conc in concs:
                xs = [c for c in cells if c["arm"] == arm and c["temperature"] == temp and c["concurrency"] == conc]
                if not xs:
                    row.append(f"{'-':>16}")
                    continue
                tp = [x["throughput"] for x in xs]
                pu = statistics.mean(x["per_user_median"] for x in xs)
                row.append(f"{statistics.mean(tp):6.1f}±{(max(tp) - min(tp)) / 2:4.1f} ({pu:4.1f})")
            lines.append(f"{arm:>14} " + " ".join(row))
    return "\n".join(lines)


def _mean_by(cells: list[dict], temp: float, key: str) -> dict[tuple[str, int], tuple[float, float]]:
    """(arm, concurrency) → (mean of `key` over repeats, half their range)."""
    out = {}
    for arm in dict.fromkeys(c["arm"] for c in cells):
        for conc in sorted({c["concurrency"] for c in cells}):
            xs = [c[key] for c in cells if c["arm"] == arm and c["temperature"] == temp and c["concurrency"] == conc]
            if xs:
                out[arm, conc] = (statistics.mean(xs), (max(xs) - min(xs)) / 2)
    return out


def per_user_at(curve: list[tuple[float, float]], throughput: float) -> float | None:
    """Per-user speed of an arm at `throughput`, interpolated linearly along its (throughput, per-user)
    points in order of concurrency; where the path crosses that throughput more than once (noise makes it
    non-monotone), the lowest per-user speed among the crossings; None outside the range it reached."""
    found = []
    for (t0, u0), (t1, u1) in zip(curve, curve[1:]):
        if min(t0, t1) <= throughput <= max(t0, t1):
            w = 0.0 if t1 == t0 else (throughput - t0) / (t1 - t0)
            found.append(u0 + w * (u1 - u0))
    return min(found) if found else None


def verdicts(results: dict, adaptive: tuple[str, ...] = ("dspark", "dspark-async"), baseline: str = "fixed:1") -> str:
    """Per temperature and concurrency: each adaptive arm against the best other arm (throughput, with the
    repeats' half range), and the adaptive arms' per-user speed at K = 1's throughput."""
    cells = results["cells"]
    lines = []
    for temp in sorted({c["temperature"] for c in cells}):
        tp = _mean_by(cells, temp, "throughput")
        pu = _mean_by(cells, temp, "per_user_median")
        arms = list(dict.fromkeys(a for a, _ in tp))
        others = [a for a in arms if a.split("+")[0] not in adaptive]
        concs = sorted({c for _, c in tp})
        lines.append(f"\nT={temp:g}: adaptive arm vs the best other arm, output tok/s (± half the repeats' range)")
        for arm in [a for a in adaptive if a in arms]:
            ahead = 0
            for conc in concs:
                if (arm, conc) not in tp:
                    continue
                best = max(others, key=lambda a: tp.get((a, conc), (float("-inf"), 0))[0])
                (m, h), (bm, bh) = tp[arm, conc], tp[best, conc]
                ok = m + h + bh >= bm
                ahead += ok
                nospec = tp.get(("none", conc), (float("nan"), 0))[0]
                lines.append(f"  {arm:>12} c={conc:>3}: {m:6.1f}±{h:4.1f} vs best other {best} {bm:6.1f}±{bh:4.1f} "
                             f"({m / bm:5.2f}x; {'within spread or ahead' if ok else 'BELOW'}), none {nospec:6.1f}")
            lines.append(f"  {arm}: at least the best other arm (within the spread) at {ahead} of {len(concs)} "
                         f"concurrencies")
        if baseline in arms:
            base = [(tp[baseline, c][0], pu[baseline, c][0]) for c in concs if (baseline, c) in tp]
            lines.append(f"T={temp:g}: per-user tok/s at {baseline}'s throughput (interpolated along each curve)")
            for arm in [a for a in adaptive if a in arms]:
                curve = [(tp[arm, c][0], pu[arm, c][0]) for c in concs if (arm, c) in tp]
                for (t, u), conc in zip(base, concs):
                    v = per_user_at(curve, t)
                    if v is not None:
                        lines.append(f"  c={conc:>3} {baseline} {t:6.1f} tok/s at {u:5.1f} per user; {arm} "
                                     f"{v:5.1f} per user ({v / u - 1:+.0%})")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    """Throughput against concurrency, and per-user speed against throughput, per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    for temp in sorted({c["temperature"] for c in cells}):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for arm in dict.fromkeys(c["arm"] for c in cells):
            xs = sorted({c["concurrency"] for c in cells if c["arm"] == arm and c["temperature"] == temp})
            if not xs:
                continue
            sel = [[c for c in cells if c["arm"] == arm and c["temperature"] == temp and c["concurrency"] == x]
                   for x in xs]
            tp = [statistics.mean(c["throughput"] for c in s) for s in sel]
            pu = [statistics.mean(c["per_user_median"] for c in s) for s in sel]
            ax1.plot(xs, tp, marker="o", label=arm)
            ax2.plot(tp, pu, marker="o", label=arm)
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("concurrent clients")
        ax1.set_ylabel("output tokens / s")
        ax2.set_xlabel("output tokens / s")
        ax2.set_ylabel("per-user tokens / s (median)")
        ax1.set_title(f"throughput, T={temp:g}")
        ax2.set_title(f"per-user speed vs throughput, T={temp:g}")
        ax1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"serve_sweep_T{temp:g}.png", dpi=120)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--requests-per-client", type=int, default=3, help="the first is warm-up")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="requests ask for lengths uniform in max_tokens·[1 - s, 1 + s] (the same per seed in every "
                         "arm); 0: all exactly max_tokens, which keeps requests that start together finishing together")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request generates exactly its length, past the target's EOS (default: it ends there)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts per domain")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--device", default="cpu", help="the servers' torch device (cuda on a GPU machine)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--profile", default=None, help="step-cost profile for the dspark arms")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--out", default="benchmarks/results/serving")
    ap.add_argument("--resume", action="store_true", help="keep the cells already in DIR/serve_sweep.json")
    ap.add_argument("--report", action="store_true", help="only print the tables and plots of DIR/serve_sweep.json")
    args = ap.parse_args()
    if args.requests_per_client < 2:
        ap.error("--requests-per-client must be >= 2 (the first request of each client is warm-up)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = Path(args.out) / "serve_sweep.json"
    results = json.loads(path.read_text()) if args.report else run(args)
    table = summarize(results) + "\n" + verdicts(results)
    print(table)
    out = Path(args.out)
    machine = results.get("machine", {})
    (out / "serve_sweep.txt").write_text(f"{results['command']}\nmachine: {machine}\n{table}\n")
    plot(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
