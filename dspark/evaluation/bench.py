"""`dspark bench`: every drafter on the held-out prompts of each domain, side by side in one process.

Prompts are run one at a time (batch 1) and the drafters take turns on each prompt, rotating the order,
so machine noise hits all of them alike; speed is reported as a ratio to target-only decoding.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from dspark.api import BUNDLED_DRAFTERS, encode_prompt, load_drafter, load_target, step_cost_model
from dspark.decoding import decode, drafter_gamma
from dspark.evaluation.metrics import acceptance_stats, tau_standard_error
from dspark.sampling import SamplingParams
from dspark.scheduling import Scheduler
from dspark.atomic import FileReadError, read_json, save_figure_atomic, write_text_atomic
from dspark.zoo import bundled_drafter_path, eval_prompts_path


def load_results(path: str | Path) -> dict:
    """A `dspark bench --json` file; a missing, truncated or malformed one raises FileReadError naming it."""
    data = read_json(path, "bench results")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise FileReadError(f"bench results {path} have no list 'runs' (not written by `dspark bench --json`?)")
    return data


def load_eval_prompts(domain: str, limit: int) -> list[str]:
    """Return the first user turns of the bundled evaluation prompts of a domain."""
    with open(eval_prompts_path(domain), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["turns"][0] for r in rows[:limit]]


EVAL_DOMAINS = ("code", "prose", "math")


def mixed_eval_prompts(limit: int, domains: tuple[str, ...] = EVAL_DOMAINS) -> list[str]:
    """The first `limit` prompts of each domain, taken in turn (code, prose, math, code, ...), so that any run of
    consecutive prompts holds the domains alike: a load benchmark whose clients take consecutive prompts sees
    the same mix at every concurrency."""
    per = [load_eval_prompts(d, limit) for d in domains]
    return [p for group in zip(*per) for p in group] + [p for ps in per for p in ps[min(map(len, per)):]]


@torch.no_grad()
def divergence_margins(target, outs, reference) -> list[float]:
    """At each greedy output's first token that differs from target-only decoding, the target's logit gap
    between the two competing tokens, from a fresh forward over the common prefix (same dtype).

    Gaps at the scale of the dtype's rounding (bf16 keeps 8 significant bits) mean the divergence is a
    near-tie argmax flip between batched verification and one-token decoding kernels, not a lossiness bug.
    """
    margins = []
    for a, b in zip(outs, reference):
        if a.token_ids == b.token_ids:
            continue
        i = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            continue
        ids = torch.tensor([a.prompt_ids + a.token_ids[:i]], device=target.device)
        logits = target.model(input_ids=ids).logits[0, -1].float()
        margins.append(abs(float(logits[a.token_ids[i]] - logits[b.token_ids[i]])))
    return margins


def _finite_or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def _se(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(
    drafters: list[str] | None,
    domains: list[str],
    temperatures: list[float],
    num_prompts: int = 20,
    max_new_tokens: int = 128,
    target_path: str | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    gamma: int | None = None,
    bias_candidates: int | None = None,
    json_path: str | None = None,
    seed: int = 0,
    plot_path: str | None = None,
    schedulers: list[str] | None = None,
    profile: str | None = None,
) -> dict:
    """Benchmark drafters (each under every scheduler given; default "fixed": the whole block verified);
    print a table and return (and optionally write) the results as a dict. An arm is named
    "drafter" under the default scheduler, else "drafter@scheduler"."""
    if drafters is None:
        drafters = ["none", "ngram"] + [n for n in BUNDLED_DRAFTERS if (bundled_drafter_path(n) / "config.json").exists()]
    if "none" not in drafters:
        drafters = ["none"] + list(drafters)
    schedulers = list(schedulers or ["fixed"])
    target = load_target(target_path, dtype, device)
    by_drafter = {name: load_drafter(name, target, gamma, bias_candidates) for name in drafters}
    arms: dict[str, tuple] = {"none": (by_drafter["none"], "fixed", None)}
    for name in drafters:
        if name == "none":
            continue
        for spec in schedulers:
            sched = Scheduler(spec, drafter_gamma(by_drafter[name]))  # a bad name fails before any run
            cost = step_cost_model(target, by_drafter[name], 1, profile) if sched.needs_cost else None
            arms[name if spec == "fixed" else f"{name}@{spec}"] = (by_drafter[name], spec, cost)
    loaded = {arm: d for arm, (d, _, _) in arms.items()}
    warm = encode_prompt(target, "def f(x):")
    for d, spec, cost in arms.values():
        decode(target, d, [warm], SamplingParams(), 8, scheduler=spec, cost_model=cost)
    drafters = list(arms)
    results: dict = {"command": " ".join(["dspark"] + sys.argv[1:]), "dtype": dtype, "device": device,
                     "max_new_tokens": max_new_tokens, "runs": []}
    for temp in temperatures:
        for domain in domains:
            prompts = [encode_prompt(target, p) for p in load_eval_prompts(domain, num_prompts)]
            seconds = {n: 0.0 for n in drafters}
            outs: dict[str, list] = {n: [] for n in drafters}
            for i, ids in enumerate(prompts):
                order = drafters[i % len(drafters):] + drafters[: i % len(drafters)]
                for name in order:
                    params = SamplingParams(temperature=temp, seed=seed + i)
                    t0 = time.perf_counter()
                    _, spec, cost = arms[name]
                    (res,) = decode(target, loaded[name], [ids], params, max_new_tokens, scheduler=spec,
                                    cost_model=cost, workloads=[domain])
                    seconds[name] += time.perf_counter() - t0
                    outs[name].append(res)
            base_tps = sum(len(r.token_ids) for r in outs["none"]) / seconds["none"]
            for name in drafters:
                tokens = sum(len(r.token_ids) for r in outs[name])
                stats = acceptance_stats([s for r in outs[name] for s in r.rounds], tokens)
                tps = tokens / seconds[name]
                prompt_tokens = [len(r.token_ids) for r in outs[name]]
                prompt_rounds = [len(r.rounds) for r in outs[name]]
                row = {
                    "temperature": temp, "domain": domain, "drafter": name, "prompts": len(prompts),
                    "scheduler": arms[name][1], "tokens": tokens, "rounds": stats.rounds, "tau": stats.tau,
                    "verified_per_round": sum(s.draft_len for r in outs[name] for s in r.rounds) / max(1, stats.rounds),
                    "tau_se": _finite_or_none(tau_standard_error(prompt_tokens, prompt_rounds)),
                    "prompt_tokens": prompt_tokens, "prompt_rounds": prompt_rounds, "histogram": stats.histogram,
                    "conditional_acceptance": stats.conditional, "cumulative_acceptance": stats.cumulative,
                    "tok_per_s": tps, "speedup": tps / base_tps, "peak_rss_mb": _peak_rss_mb(),
                }
                if temp == 0.0:
                    same = [a.token_ids == b.token_ids for a, b in zip(outs[name], outs["none"])]
                    row["identical_to_target_only"] = sum(same) / len(same)
                    row["divergence_margins"] = divergence_margins(target, outs[name], outs["none"])
                if device.startswith("cuda"):
                    row["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
                results["runs"].append(row)
            print(_format_block(temp, domain, [r for r in results["runs"] if r["temperature"] == temp and r["domain"] == domain]), flush=True)
    for temp in temperatures:
        for name in drafters:
            rows = [r for r in results["runs"] if r["temperature"] == temp and r["drafter"] == name]
            results.setdefault("macro", []).append({
                "temperature": temp, "drafter": name,
                "tau": sum(r["tau"] for r in rows) / len(rows),
                "tau_se": (None if any(r["tau_se"] is None for r in rows)
                           else math.sqrt(sum(r["tau_se"] ** 2 for r in rows)) / len(rows)),
                "speedup": sum(r["speedup"] for r in rows) / len(rows),
            })
    print("\n== macro average over domains")
    for m in results["macro"]:
        print(f"T={m['temperature']:<4} {m['drafter']:<14} tau={m['tau']:.2f}±{_se(m['tau_se'])} speedup={m['speedup']:.2f}x")
    if json_path:
        write_text_atomic(json_path, json.dumps(results, indent=1))
    if plot_path:
        plot_acceptance(results, plot_path)
    return results


def plot_acceptance(results: dict, path: str) -> None:
    """PNG of conditional per-position acceptance per drafter, averaged over domains, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    temps = sorted({r["temperature"] for r in results["runs"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        names = [n for n in dict.fromkeys(r["drafter"] for r in results["runs"]) if n != "none"]
        for name in names:
            rows = [r["conditional_acceptance"] for r in results["runs"]
                    if r["temperature"] == temp and r["drafter"] == name and r["conditional_acceptance"]]
            if not rows:
                continue
            width = min(len(r) for r in rows)
            mean = [sum(r[k] for r in rows) / len(rows) for k in range(width)]
            ax.plot(range(1, width + 1), mean, marker="o", label=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"temperature {temp}")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)
    plt.close(fig)


def _format_block(temp: float, domain: str, rows: list[dict]) -> str:
    lines = [f"\n== domain={domain} temperature={temp}",
             f"{'drafter':<14}{'tau':>6}{'± se':>6}{'tok/s':>9}{'speedup':>9}{'same':>7}{'rss MB':>8}  conditional acceptance by position"
             " | histogram (accepted drafts 0..γ)"]
    for r in rows:
        same = f"{r['identical_to_target_only']:.2f}" if "identical_to_target_only" in r else "-"
        gaps = r.get("divergence_margins") or []
        note = f"  first-divergence logit gaps: max {max(gaps):.3f}, median {sorted(gaps)[len(gaps) // 2]:.3f}" if gaps else ""
        lines.append(f"{r['drafter']:<14}{r['tau']:>6.2f}{_se(r['tau_se']):>6}{r['tok_per_s']:>9.1f}{r['speedup']:>8.2f}x{same:>7}"
                     f"{r['peak_rss_mb']:>8.0f}  {[round(a, 2) for a in r['conditional_acceptance']]} | {r['histogram']}{note}")
    return "\n".join(lines)
