"""Sustained load on `dspark serve`: closed-loop streaming clients for minutes; memory, KV cache, throughput, /health.

    python benchmarks/sustained_load.py [--minutes 10] [--clients 32] [--max-tokens 64] [--sample-every 10]
        [--health-every 1] [--settle 60] [--prompts 10] [--scheduler dspark] [--drafter dspark]
        [--dtype float32] [--profile FILE] [--port 0] [--out benchmarks/results/hardening]

Issue 16 §2 "Sustained load". The script starts `dspark serve --scheduler SCHED --max-running CLIENTS` (the
bundled target and drafter; float32 so that greedy outputs can be compared token for token) and runs CLIENTS
closed-loop clients with the official `openai` async client (one process, one thread), each sending greedy
streaming requests (temperature 0, --max-tokens) back to back for --minutes, alternating chat completions
(ending at EOS or --max-tokens) and completions (ignore_eos: the chat-tuned target ends a raw prompt at once)
over the bundled held-out prompts (--prompts per domain: code, prose, math).
A sampler thread polls /health every --health-every seconds (status and latency) and every --sample-every
seconds records the server process's RSS (/proc/PID/status VmRSS), its open file descriptors, and from
/metrics the committed tokens, finished requests, running / waiting requests, the target KV cache's allocated
size (dspark:kv_cache_tokens, rows x slot width; dspark:kv_cache_bytes) and the tokens admitted requests
reserve (dspark:kv_reserved_tokens). Once the clients stop, it waits for the server to go idle and samples
once more (the drained values: the KV cache and the reservations must be back to 0), stops the server, and
only then (so they take no CPU from the load) decodes every distinct prompt used alone, target-only
(`dspark.decode` with `NoDrafter`), to check every greedy output against it.

Reported: requests, errors, mismatches; throughput per interval (mean, sd, and its trend) over the intervals
after --settle seconds; RSS and KV-cache slopes (least squares over the samples after --settle seconds, with
their standard errors); /health p50 / p99 latency and any non-200. Writes OUT/sustained_load.json,
OUT/sustained_load.txt and OUT/sustained_load.png (RSS, KV cache, throughput and /health latency vs time).
`tests/test_sustained_load.py` drives an in-process server for ~20 s with the same functions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark.evaluation.bench import load_eval_prompts

sys.path.insert(0, str(Path(__file__).parent))
import serve_sweep  # noqa: E402  (its server start-up check and machine description)

GAUGES = {  # sample key → /metrics sample name (summed over labels)
    "generation_tokens": "dspark:generation_tokens_total",
    "finished": "dspark:request_success_total",
    "running": "dspark:num_requests_running",
    "waiting": "dspark:num_requests_waiting",
    "kv_cache_tokens": "dspark:kv_cache_tokens",
    "kv_cache_bytes": "dspark:kv_cache_bytes",
    "kv_reserved_tokens": "dspark:kv_reserved_tokens",
}
Job = tuple[str, bool]  # (prompt text, chat?); completions ask for ignore_eos (see load_jobs)


# ---------------------------------------------------------------------- what the clients send
def load_jobs(per_domain: int) -> list[Job]:
    """The held-out prompts of every domain, each as a chat turn and as a plain completion, interleaved.

    Completions ask for ignore_eos: the bundled target is chat-tuned and ends a raw prompt at once (one
    token), so they would load nothing but prefill; chat turns stop where the model stops."""
    prompts = [p for d in ("code", "prose", "math") for p in load_eval_prompts(d, per_domain)]
    return [(p, chat) for p in prompts for chat in (True, False)]


async def one_request(client, model: str, jobs: list[Job], i: int, max_tokens: int) -> dict:
    """One greedy streaming request of job i; its text, finish reason, usage, times, or its error."""
    prompt, chat = jobs[i]
    rec = {"job": i, "chat": chat, "start": time.perf_counter(), "first": None, "end": None, "text": "",
           "finish": None, "tokens": None, "error": None}
    parts = []
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": not chat})
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=prompt, **kw)
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                text = (choice.delta.content if chat else choice.text) or ""
                if text and rec["first"] is None:
                    rec["first"] = time.perf_counter()
                parts.append(text)
                rec["finish"] = choice.finish_reason or rec["finish"]
            if chunk.usage is not None:
                rec["tokens"] = chunk.usage.completion_tokens
    except Exception as err:  # noqa: BLE001 - every failure is counted, none stops the load
        rec["error"] = f"{type(err).__name__}: {err}"
    rec["end"] = time.perf_counter()
    rec["text"] = "".join(parts)
    if rec["error"] is None and (rec["finish"] not in ("stop", "length") or rec["tokens"] is None):
        rec["error"] = f"incomplete stream: finish_reason {rec['finish']!r}, usage {rec['tokens']!r}"
    return rec


async def closed_loop(base: str, model: str, jobs: list[Job], clients: int, seconds: float,
                      max_tokens: int) -> list[dict]:
    """`clients` clients, each sending requests back to back until `seconds` have passed (at least one each;
    the last ones run to their end). Client w's j-th request is job (7 w + j) mod len(jobs): every client
    walks the jobs in turn (chat and completion alternate), from its own place."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=3600)
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> list[dict]:
        done: list[dict] = []
        while not done or time.perf_counter() < deadline:
            done.append(await one_request(client, model, jobs, (7 * w + len(done)) % len(jobs), max_tokens))
        return done

    try:
        per_client = await asyncio.gather(*(worker(w) for w in range(clients)))
    finally:
        await client.close()
    return [r for records in per_client for r in records]


# ---------------------------------------------------------------------- what the sampler reads
def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.M).group(1)) / 1024


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory of process `pid` in MiB (VmHWM)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+)\s+kB", text, re.M).group(1)) / 1024


def open_fds(pid: int) -> int:
    """File descriptors process `pid` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(http: httpx.Client, base: str) -> dict[str, float]:
    """The GAUGES samples of /metrics (summed over labels)."""
    names = {v: k for k, v in GAUGES.items()}
    out = {k: 0.0 for k in GAUGES}
    for family in text_string_to_metric_families(http.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


class Sampler(threading.Thread):
    """Polls /health every `health_every` s and samples RSS, fds and /metrics every `sample_every` s."""

    def __init__(self, base: str, pid: int, sample_every: float, health_every: float) -> None:
        super().__init__(name="sustained-load-sampler", daemon=True)
        self.base, self.pid = base, pid
        self.sample_every, self.health_every = sample_every, health_every
        self.samples: list[dict] = []
        self.health: list[dict] = []  # {"t", "status", "seconds"}
        self.t0 = time.perf_counter()
        self._halt = threading.Event()

    def sample(self, http: httpx.Client) -> dict:
        """One sample of the server's memory, descriptors and gauges, at seconds since t0."""
        return {"t": time.perf_counter() - self.t0, "rss_mb": rss_mb(self.pid), "fds": open_fds(self.pid),
                "loadavg": float(Path("/proc/loadavg").read_text().split()[0]), **scrape(http, self.base)}

    def poll_health(self, http: httpx.Client) -> dict:
        """One /health call: its status (None when it failed) and latency."""
        start = time.perf_counter()
        try:
            status = http.get(f"{self.base}/health").status_code
        except httpx.HTTPError:
            status = None
        return {"t": start - self.t0, "status": status, "seconds": time.perf_counter() - start}

    def run(self) -> None:
        next_sample = 0.0
        with httpx.Client(timeout=30) as http:
            while True:
                if time.perf_counter() - self.t0 >= next_sample:
                    self.samples.append(self.sample(http))
                    next_sample += self.sample_every
                self.health.append(self.poll_health(http))
                if self._halt.wait(self.health_every):
                    self.samples.append(self.sample(http))  # the moment the clients stopped
                    return

    def stop(self) -> None:
        """Take a last sample and stop."""
        self._halt.set()
        self.join()


def wait_idle(base: str, limit: float = 600.0) -> None:
    """Wait until /metrics shows no request running or waiting."""
    deadline = time.perf_counter() + limit
    with httpx.Client(timeout=30) as http:
        while True:
            m = scrape(http, base)
            if m["running"] == 0 and m["waiting"] == 0:
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the server did not go idle in {limit} s: {m}")
            time.sleep(0.1)


def drive(base: str, model: str, pid: int, jobs: list[Job], clients: int, seconds: float, max_tokens: int,
          sample_every: float, health_every: float) -> dict:
    """Run the closed loop with the sampler beside it; then wait for the server to drain and sample it.

    Returns {"records", "samples" (t since the load began), "health", "seconds" (the load's length),
    "drained" (a sample once idle)}."""
    sampler = Sampler(base, pid, sample_every, health_every)
    sampler.start()
    try:
        records = asyncio.run(closed_loop(base, model, jobs, clients, seconds, max_tokens))
    finally:
        sampler.stop()
    for r in records:
        for key in ("start", "first", "end"):
            if r[key] is not None:
                r[key] -= sampler.t0
    wait_idle(base)
    with httpx.Client(timeout=30) as http:
        drained = sampler.sample(http)
    return {"records": records, "samples": sampler.samples, "health": sampler.health, "seconds": seconds,
            "drained": drained}


# ---------------------------------------------------------------------- checking and figures
def references(target, jobs: list[Job], used: set[int], max_tokens: int) -> dict[int, dict]:
    """Each used job decoded alone, target-only and greedy: {job: {"text", "tokens", "finish"}}."""
    import torch

    from dspark.api import encode_prompt
    from dspark.decoding import decode
    from dspark.drafters.base import NoDrafter

    out = {}
    # One row of a small model: a second intra-op thread gains little, and while another process holds a
    # core, two-thread kernels wait on each other (measured here: 0.35 s -> 15 s for 32 tokens).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in sorted(used):
            prompt, chat = jobs[i]
            ids = encode_prompt(target, prompt, chat=chat)
            eos = None if chat else frozenset()  # completions: ignore_eos
            tokens = decode(target, NoDrafter(), [ids], max_new_tokens=max_tokens, eos_token_ids=eos)[0].token_ids
            stopped = chat and (len(tokens) < max_tokens or (bool(tokens) and tokens[-1] in target.eos_token_ids))
            out[i] = {"text": target.tokenizer.decode(tokens, skip_special_tokens=True), "tokens": len(tokens),
                      "finish": "stop" if stopped else "length"}
    finally:
        torch.set_num_threads(threads)
    return out


def check_outputs(records: list[dict], refs: dict[int, dict]) -> list[dict]:
    """The completed records whose text, usage or finish reason differ from their standalone decoding."""
    bad = []
    for r in records:
        if r["error"] is not None:
            continue
        ref = refs[r["job"]]
        if (r["text"], r["tokens"], r["finish"]) != (ref["text"], ref["tokens"], ref["finish"]):
            at = next((k for k, (a, b) in enumerate(zip(r["text"], ref["text"])) if a != b),
                      min(len(r["text"]), len(ref["text"])))
            bad.append({"job": r["job"], "chat": r["chat"], "first_difference_at_char": at,
                        "got": {"text": r["text"], "tokens": r["tokens"], "finish": r["finish"]},
                        "expected": ref})
    return bad


def fit(ts: list[float], ys: list[float]) -> dict:
    """Least-squares line y = a + b t: slope b, its standard error, and n."""
    n = len(ts)
    if n < 3:
        return {"slope": float("nan"), "se": float("nan"), "n": n}
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    sxx = sum((t - mt) ** 2 for t in ts)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx
    a = my - b * mt
    ssr = sum((y - a - b * t) ** 2 for t, y in zip(ts, ys))
    return {"slope": b, "se": math.sqrt(ssr / (n - 2) / sxx), "n": n}


def intervals(samples: list[dict], end: float) -> list[dict]:
    """Per pair of consecutive samples ending by `end`: its midpoint, tokens/s and requests finished."""
    out = []
    for a, b in zip(samples, samples[1:]):
        if b["t"] <= end + 1e-6 and b["t"] > a["t"]:
            dt = b["t"] - a["t"]
            out.append({"t": (a["t"] + b["t"]) / 2, "t_start": a["t"],
                        "tokens_per_s": (b["generation_tokens"] - a["generation_tokens"]) / dt,
                        "requests": b["finished"] - a["finished"]})
    return out


def rss_steps(samples: list[dict], steady: list[dict], min_mb: float = 1.0) -> list[dict]:
    """Each rise of RSS by min_mb or more between consecutive steady samples, and whether the KV cache's bytes
    reached a new maximum of the run in that interval (an allocator high-water mark rather than a leak)."""
    out = []
    for a, b in zip(steady, steady[1:]):
        if b["rss_mb"] - a["rss_mb"] >= min_mb:
            before = max(x["kv_cache_bytes"] for x in samples if x["t"] <= a["t"])
            out.append({"t": b["t"], "mb": b["rss_mb"] - a["rss_mb"],
                        "new_kv_max": b["kv_cache_bytes"] > before})
    return out


def figures(run: dict, mismatches: int, settle: float) -> dict:
    """The report's numbers (slopes per minute over the samples after `settle` seconds)."""
    records, samples, end = run["records"], run["samples"], run["seconds"]
    steady = [s for s in samples if settle <= s["t"] <= end + 1e-6]
    if len(steady) < 3:  # a short run: fall back to everything after the first third
        steady = [s for s in samples if end / 3 <= s["t"] <= end + 1e-6]
    per_min = [s["t"] / 60 for s in steady]
    ivals = [iv for iv in intervals(samples, end) if iv["t_start"] >= (steady[0]["t"] if steady else 0)]
    tps = [iv["tokens_per_s"] for iv in ivals]
    half = len(tps) // 2
    health = run["health"]
    lat = [h["seconds"] for h in health if h["status"] == 200]
    done = [r for r in records if r["error"] is None]
    e2e = [r["end"] - r["start"] for r in done]
    ttft = [r["first"] - r["start"] for r in done if r["first"] is not None]

    def series(key: str, scale: float = 1.0) -> dict:
        ys = [s[key] * scale for s in steady]
        f = fit(per_min, ys)
        return {"first": samples[0][key] * scale, "last_under_load": samples[-1][key] * scale,
                "growth_steady": (steady[-1][key] - steady[0][key]) * scale if steady else None,
                "max": max(s[key] for s in samples) * scale, "mean_steady": statistics.fmean(ys) if ys else None,
                "drained": run["drained"][key] * scale, "slope_per_min": f["slope"], "slope_se": f["se"],
                "n": f["n"]}

    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "error_examples": sorted({r["error"] for r in records if r["error"] is not None})[:5],
        "mismatches": mismatches,
        "distinct_jobs": len({r["job"] for r in records}),
        "tokens": sum(r["tokens"] or 0 for r in done),
        "steady_from_s": steady[0]["t"] if steady else None,
        "throughput": {"intervals": len(tps), "mean": statistics.fmean(tps) if tps else None,
                       "sd": statistics.stdev(tps) if len(tps) > 1 else None,
                       "cv": statistics.stdev(tps) / statistics.fmean(tps) if len(tps) > 1 else None,
                       "first_half_mean": statistics.fmean(tps[:half]) if half else None,
                       "second_half_mean": statistics.fmean(tps[half:]) if half else None,
                       "trend": fit([iv["t"] / 60 for iv in ivals], tps)},
        "rss_mb": {**series("rss_mb"), "peak_vmhwm": run.get("peak_rss_mb")},
        "kv_cache_tokens": series("kv_cache_tokens"),
        "rss_steps": rss_steps(samples, steady),
        "kv_cache_mb": series("kv_cache_bytes", 1 / 2 ** 20),
        "kv_reserved_tokens": series("kv_reserved_tokens"),
        # The KV budget counts each request's own tokens; the cache holds rows x the widest row (and holes
        # until it compacts): how much more it allocates than the admitted requests reserve.
        "kv_allocated_per_reserved": statistics.fmean(s["kv_cache_tokens"] / s["kv_reserved_tokens"]
                                                      for s in steady if s["kv_reserved_tokens"] > 0)
        if any(s["kv_reserved_tokens"] > 0 for s in steady) else None,
        "fds": series("fds"),
        "loadavg_mean": statistics.fmean(s["loadavg"] for s in samples),
        "health": {"polls": len(health), "non_200": sum(1 for h in health if h["status"] != 200),
                   "p50_ms": serve_sweep.percentile(lat, 0.5) * 1e3, "p99_ms": serve_sweep.percentile(lat, 0.99) * 1e3,
                   "max_ms": max(lat) * 1e3 if lat else None},
        "latency": {"e2e_p50_s": serve_sweep.percentile(e2e, 0.5), "e2e_p99_s": serve_sweep.percentile(e2e, 0.99),
                    "ttft_p50_s": serve_sweep.percentile(ttft, 0.5), "ttft_p99_s": serve_sweep.percentile(ttft, 0.99)},
    }


def num(x, spec: str = ".1f") -> str:
    """x formatted, or "n/a" for None / NaN (a run too short for a figure)."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def summary_text(result: dict) -> str:
    """The text report."""
    f, s = result["figures"], result["settings"]
    tp, rss, kv, kvb, res, fds, h, lat = (f["throughput"], f["rss_mb"], f["kv_cache_tokens"], f["kv_cache_mb"],
                                          f["kv_reserved_tokens"], f["fds"], f["health"], f["latency"])

    def slope(d: dict, unit: str) -> str:
        return f"{num(d['slope_per_min'], '+.3g')} ± {num(d['slope_se'], '.2g')} {unit}/min (n={d['n']})"

    length = (f"a {s['minutes']:g}-minute run, not the 10 minutes the issue asks for" if s["minutes"] < 10
              else "the full length")
    return "\n".join([
        "Sustained load on dspark serve (issue 16 §2; benchmarks/sustained_load.py)",
        f"command: {result['command']}",
        f"date: {result['date']}; machine: {result['machine']}",
        f"server: {' '.join(result['server_command'])}",
        f"run: {s['clients']} closed-loop streaming clients (openai AsyncOpenAI, one process) for {s['minutes']:g} "
        f"minutes ({length}); greedy, max_tokens {s['max_tokens']}, chat (to EOS) and completions (ignore_eos) over "
        f"{f['distinct_jobs']} distinct jobs; sampled every {s['sample_every']:g} s, /health every "
        f"{s['health_every']:g} s; slopes and noise over the samples from {num(f['steady_from_s'], '.0f')} s on "
        f"(the first part holds one-off growth: the DSpark drafter fills its [V, V] float32 Markov bias table, "
        f"256 MiB at V = 8192, lazily; allocator pools grow to the largest batch)",
        "",
        f"requests: {f['requests']} ({f['completed']} completed, {f['errors']} errors), {f['tokens']} tokens; "
        f"greedy outputs differing from their standalone target-only decoding: {f['mismatches']}",
        f"throughput per {s['sample_every']:g}-s interval: mean {num(tp['mean'])} tok/s, sd {num(tp['sd'])} "
        f"(cv {num(tp['cv'], '.1%')}, {tp['intervals']} intervals); first half {num(tp['first_half_mean'])}, "
        f"second half {num(tp['second_half_mean'])}; trend {num(tp['trend']['slope'], '+.2f')} ± "
        f"{num(tp['trend']['se'], '.2f')} tok/s per min",
        f"server RSS: {num(rss['first'], '.0f')} MB at the start, {num(rss['last_under_load'], '.0f')} MB at the "
        f"end, max {num(rss['max'], '.0f')} MB, {num(rss['drained'], '.0f')} MB drained (VmHWM "
        f"{num(rss['peak_vmhwm'], '.0f')} MB); slope {slope(rss, 'MB')}, growth over those samples "
        f"{num(rss['growth_steady'], '+.1f')} MB",
        "RSS rises between the samples above: " + (", ".join(
            f"{x['mb']:+.1f} MB at {x['t']:.0f} s ({'with' if x['new_kv_max'] else 'without'} a new KV-cache maximum)"
            for x in f["rss_steps"]) or "none"),
        f"KV cache (target, allocated): mean {num(kv['mean_steady'], '.0f')} tokens ({num(kvb['mean_steady'])} MB), "
        f"max {num(kv['max'], '.0f')} ({num(kvb['max'])} MB); slope {slope(kv, 'tokens')}; drained "
        f"{num(kv['drained'], '.0f')} tokens, {num(kvb['drained'], '.2f')} MB",
        f"KV reserved by admitted requests: mean {num(res['mean_steady'], '.0f')}, max {num(res['max'], '.0f')} "
        f"tokens; slope {slope(res, 'tokens')}; drained {num(res['drained'], '.0f')}; the cache allocates "
        f"{num(f['kv_allocated_per_reserved'], '.2f')}x what the requests reserve (mean of the samples: rows are "
        f"padded to the widest row, rolled-back slots wait for compaction)",
        f"open fds: {num(fds['first'], '.0f')} at the start, {num(fds['last_under_load'], '.0f')} at the end, "
        f"{num(fds['drained'], '.0f')} drained",
        f"/health: {h['polls']} polls under load, {h['non_200']} not 200; latency p50 {num(h['p50_ms'])} ms, "
        f"p99 {num(h['p99_ms'])} ms, max {num(h['max_ms'])} ms",
        f"request latency: e2e p50 {num(lat['e2e_p50_s'], '.2f')} s, p99 {num(lat['e2e_p99_s'], '.2f')} s; "
        f"TTFT p50 {num(lat['ttft_p50_s'], '.2f')} s, p99 {num(lat['ttft_p99_s'], '.2f')} s",
        f"server exit code after SIGTERM: {result['server_exit']}; tracebacks in its log: {result['tracebacks']}",
        f"machine load (1-min load average, {result['machine']['cores']} cores) during the run: mean "
        f"{num(f['loadavg_mean'], '.2f')} (server and clients take about 2; more means other processes competed)",
    ] + (["errors: " + "; ".join(f["error_examples"])] if f["error_examples"] else [])) + "\n"


def plot(result: dict, path: Path) -> None:
    """RSS, KV cache (allocated and reserved), throughput per interval and /health latency vs time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, run_s = result["samples"], result["settings"]["minutes"] * 60
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(t, [s["rss_mb"] for s in samples], marker=".")
    axes[0].set_ylabel("server RSS (MB)")
    axes[1].plot(t, [s["kv_cache_tokens"] for s in samples], marker=".", label="allocated (rows x width)")
    axes[1].plot(t, [s["kv_reserved_tokens"] for s in samples], marker=".", label="reserved")
    axes[1].set_ylabel("KV cache tokens")
    axes[1].legend(fontsize=8)
    ivals = intervals(samples, run_s)
    axes[2].plot([iv["t"] / 60 for iv in ivals], [iv["tokens_per_s"] for iv in ivals], marker=".")
    axes[2].set_ylabel("output tok/s")
    health = result["health"]
    axes[3].plot([h["t"] / 60 for h in health], [h["seconds"] * 1e3 for h in health], ".", ms=3)
    axes[3].set_ylabel("/health latency (ms)")
    axes[3].set_xlabel("minutes since the load began")
    steady = result["figures"]["steady_from_s"]
    for ax in axes:
        if steady is not None:  # where the slopes start
            ax.axvline(steady / 60, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    fig.suptitle(f"dspark serve, {result['settings']['clients']} streaming clients, "
                 f"{result['settings']['minutes']:g} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_report(result: dict, out: Path) -> int:
    """Write OUT/sustained_load.{json,txt,png}, print the text; 0 when nothing failed."""
    (out / "sustained_load.json").write_text(json.dumps(result, indent=1))
    summary = summary_text(result)
    (out / "sustained_load.txt").write_text(summary)
    plot(result, out / "sustained_load.png")
    print(summary)
    f = result["figures"]
    return 0 if f["errors"] == 0 and f["mismatches"] == 0 and f["health"]["non_200"] == 0 else 1


def report(out: Path) -> int:
    """Recompute the figures of a saved run (its settings, requests, samples and mismatch count)."""
    result = json.loads((out / "sustained_load.json").read_text())
    s = result["settings"]
    run = {"records": result["requests"], "samples": result["samples"], "health": result["health"],
           "seconds": s["minutes"] * 60, "drained": result["drained"],
           "peak_rss_mb": result["figures"]["rss_mb"]["peak_vmhwm"]}
    result["figures"] = figures(run, result["figures"]["mismatches"], s["settle"])
    return write_report(result, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory / metrics samples")
    ap.add_argument("--health-every", type=float, default=1.0, help="seconds between /health polls")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds of warm-up left out of slopes and noise")
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts per domain (each chat + completion)")
    ap.add_argument("--scheduler", default="dspark")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--dtype", default="float32", help="float32: greedy outputs are compared token for token")
    ap.add_argument("--profile", default=None, help="step-cost profile (default: the cache, measured on start)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--out", default="benchmarks/results/hardening")
    ap.add_argument("--report", action="store_true",
                    help="only recompute the figures, text and plot from OUT/sustained_load.json")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return report(out)
    port = args.port or free_port()
    base, model = f"http://127.0.0.1:{port}", "target"
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--scheduler", args.scheduler, "--drafter", args.drafter,
           "--dtype", args.dtype, "--max-running", str(args.clients), "--port", str(port),
           "--served-model-name", model]
    if args.profile:
        cmd += ["--profile", args.profile]
    jobs = load_jobs(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            serve_sweep.wait_healthy(proc, base, args.start_timeout, log)
            print(f"server up (pid {proc.pid}); {args.clients} clients for {args.minutes:g} min", flush=True)
            run = drive(base, model, proc.pid, jobs, args.clients, args.minutes * 60, args.max_tokens,
                        args.sample_every, args.health_every)
            run["peak_rss_mb"] = peak_rss_mb(proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        text = log.read_text(errors="replace")
        tracebacks = text.count("Traceback (most recent call last)")
    print(f"load done: {len(run['records'])} requests; decoding the references alone", flush=True)
    from dspark.api import load_target

    target = load_target(dtype=args.dtype)
    used = {r["job"] for r in run["records"]}
    refs = references(target, jobs, used, args.max_tokens)
    mismatches = check_outputs(run["records"], refs)
    result = {
        "command": "python benchmarks/sustained_load.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": serve_sweep.machine(),
        "server_command": ["python"] + cmd[1:],
        "settings": vars(args),
        "server_exit": proc.returncode,
        "tracebacks": tracebacks,
        "figures": figures(run, len(mismatches), args.settle),
        "samples": run["samples"],
        "drained": run["drained"],
        "health": run["health"],
        "mismatch_examples": mismatches[:5],
        "requests": [{k: r[k] for k in ("job", "chat", "start", "first", "end", "tokens", "finish", "error")}
                     for r in run["records"]],
    }
    return write_report(result, out)


if __name__ == "__main__":
    sys.exit(main())
