"""Online survival calibration under a workload shift, on rounds of the bundled target and DSpark drafter.

    python benchmarks/online_calibration.py [--temperature 1.0] [--prompts 40] [--max-new-tokens 128]

1. Record labelled rounds (`record_rounds`, whole blocks verified) of the uncalibrated DSpark drafter on
   code fitting prompts [60, 60 + N) and on held-out prose and math prompts [0, N); cached under
   data/online_calibration/ so reruns skip decoding.
2. Fit the offline calibration on code only (Sequential Temperature Scaling).
3. Switch the workload: stream the prose and math rounds (shuffled arrival order, workload label None, so
   the pooled default workload) through an `OnlineCalibrator`. Prequentially, each round is scored by the
   offline-only calibration and by the online one before the calibrator observes it; every 25 rounds the
   pooled cumulative ECE (20 bins) over the last 300 scored rounds is logged. A hindsight STS fit on the whole
   stream (in-sample, so optimistic) shows the ECE floor a 300-round window allows.
4. Poisoning on real rounds: a workload 'attack' whose rounds are all rejected (accepted = 0) against the
   'prose' workload; a single request flooding the default workload, with and without the share cap; many
   attacking requests on the default workload (only the rate limit bounds them).

Writes results.json, ece_vs_rounds.png and summary.txt into benchmarks/results/online_calibration/.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from dspark.calibration.fit import fit_sequential_temperature
from dspark.calibration.maps import Calibration, json_safe
from dspark.calibration.metrics import ece
from dspark.calibration.online import OnlineCalibrator
from dspark.calibration.records import RoundRecords

CACHE = Path("data/online_calibration")
OUT = Path("benchmarks/results/online_calibration")
TARGET_ECE = 0.03


def cached_rounds(target, drafter, domain: str, start: int, count: int, temperature: float, max_new_tokens: int,
                  batch_size: int, seed: int) -> RoundRecords:
    """Recorded rounds of prompts [start, start + count) of a domain, read from data/ when already recorded."""
    path = CACHE / f"{domain}_p{start}-{start + count}_T{temperature:g}_n{max_new_tokens}_b{batch_size}_s{seed}.safetensors"
    if path.is_file():
        return RoundRecords.load(path)
    from dspark.calibration.job import domain_prompts, record_rounds

    t0 = time.perf_counter()
    rec = record_rounds(target(), drafter(), domain_prompts(target(), domain, start, count), temperature,
                        max_new_tokens, batch_size, seed, domain)
    rec.save(path)
    seconds = time.perf_counter() - t0
    path.with_suffix(".json").write_text(json.dumps({"record_seconds": seconds, "rounds": len(rec)}) + "\n")
    print(f"recorded {len(rec)} {domain} rounds in {seconds:.0f} s -> {path}", flush=True)
    return rec


def record_seconds(domain: str, start: int, count: int, temperature: float, max_new_tokens: int, batch_size: int,
                   seed: int) -> float | None:
    """Wall seconds the cached rounds took to record (None if unknown)."""
    path = CACHE / f"{domain}_p{start}-{start + count}_T{temperature:g}_n{max_new_tokens}_b{batch_size}_s{seed}.json"
    try:
        return float(json.loads(path.read_text())["record_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pad_to(records: RoundRecords, gamma: int) -> RoundRecords:
    """The records widened to γ positions (NaN signals past their width)."""
    if records.gamma == gamma:
        return records
    sig = torch.full((len(records), gamma, records.signals.shape[2]), float("nan"))
    sig[:, : records.gamma] = records.signals
    return RoundRecords(sig, records.available, records.accepted, records.greedy, records.domain)


def pooled_ece(survival: torch.Tensor, records: RoundRecords) -> float:
    """Cumulative ECE pooled over positions k ≤ available."""
    labels, valid = records.cumulative_labels()
    return ece(survival[valid], labels[valid])


def pooled_ece_se(survival: torch.Tensor, records: RoundRecords) -> float:
    """Standard error of `pooled_ece` by resampling prompts (the rounds of one prompt are drawn together)."""
    from dspark.calibration.metrics import ece_std_error

    labels, valid = records.cumulative_labels()
    clusters = records.clusters().view(-1, 1).expand_as(valid)
    return ece_std_error(survival[valid], labels[valid], clusters[valid])


def make_calibrator(prior: Calibration, gamma: int, args: argparse.Namespace, **overrides) -> OnlineCalibrator:
    kw = {"decay": args.decay, "refit_every": args.refit_every, "max_step": args.max_step, "min_rounds": args.min_rounds,
              "max_request_share": args.max_request_share, "position_ridge": args.position_ridge,
              "sampled_temperature": max(args.temperature, 0.0) or 1.0}
    kw.update(overrides)
    return OnlineCalibrator(prior, gamma, **kw)


def prequential(stream: RoundRecords, offline: Calibration, online: OnlineCalibrator, hindsight: Calibration,
                temperature: float, window: int, every: int) -> dict:
    """Score every round with each calibration before the online one observes it; windowed ECE every `every`."""
    n, gamma = len(stream), stream.gamma
    scores = {name: torch.zeros(n, gamma) for name in ("offline", "online", "hindsight")}
    greedy = temperature <= 0
    for i in range(n):
        sig, avail = stream.signals[i : i + 1], stream.available[i : i + 1]
        scores["offline"][i] = offline.survival(sig, avail, [temperature])[0]
        scores["online"][i] = online.survival(sig, avail, [temperature], [None])[0]
        online.observe(stream.signals[i], int(avail), int(stream.accepted[i]), greedy, None, None, True,
                       temperature)
    scores["hindsight"] = hindsight.survival(stream.signals, stream.available, [temperature] * n)
    checkpoints = []
    for t in range(every, n + 1, every):
        lo = max(0, t - window)
        part = stream.subset((torch.arange(n) >= lo) & (torch.arange(n) < t))
        checkpoints.append({"rounds": t, "window_rounds": t - lo,
                            **{f"{name}_ece": pooled_ece(s[lo:t], part) for name, s in scores.items()}})
    late = stream.subset(torch.arange(n) >= window)
    return {"checkpoints": checkpoints,
            "whole_stream_ece": {name: pooled_ece(s, stream) for name, s in scores.items()},
            f"ece_from_round_{window}": {name: pooled_ece(s[window:], late) for name, s in scores.items()}
            if n > window else {}}


def frozen_after(stream: RoundRecords, offline: Calibration, online: OnlineCalibrator, temperature: float,
                 rounds: int) -> dict:
    """The online calibrator after it has observed the first `rounds` rounds of the stream, then frozen: its
    and the offline-only calibration's pooled cumulative ECE on every later round (one large sample, not a
    300-round window), each with the noise floor of its own predictions on those rounds."""
    from dspark.calibration.metrics import ece_noise_floor

    greedy = temperature <= 0
    for i in range(min(rounds, len(stream))):
        online.observe(stream.signals[i], int(stream.available[i]), int(stream.accepted[i]), greedy, None, None,
                       True, temperature)
    late = stream.subset(torch.arange(len(stream)) >= rounds)
    if not len(late):
        return {}
    temps = [temperature] * len(late)
    out = {"after_rounds": rounds, "scored_rounds": len(late)}
    everything = torch.ones(len(late), dtype=torch.bool)
    for name, cal in (("offline", offline), ("online_frozen", online)):
        a = cal.survival(late.signals, late.available, temps, [None] * len(late)) if name != "offline" else \
            cal.survival(late.signals, late.available, temps)
        a = a.to(torch.float64)
        prev = torch.cat([torch.ones_like(a[:, :1]), a[:, :-1]], dim=1)
        cond = torch.where(prev > 0, a / prev.clamp_min(1e-12), torch.zeros_like(a)).clamp(0, 1)
        out[f"{name}_ece"] = pooled_ece(a, late)
        out[f"{name}_se"] = pooled_ece_se(a, late)
        out[f"{name}_floor"] = ece_noise_floor(cond, late.available, everything)
    return out


def first_reach(checkpoints: list[dict], key: str, level: float) -> int | None:
    """First checkpoint round from which `key` stays ≤ level to the end (None if never)."""
    ok = [c[key] <= level for c in checkpoints]
    for i in range(len(ok)):
        if all(ok[i:]):
            return checkpoints[i]["rounds"]
    return None


def poisoning(prose: RoundRecords, attack_src: RoundRecords, prior: Calibration, temperature: float,
              args: argparse.Namespace) -> dict:
    """Forced-rejection attacks against real prose rounds; how far they move the victim's survival."""
    greedy = temperature <= 0
    n = len(prose)
    temps = [temperature] * n

    def run(victim: str | None, attack_label: str | None, per_round: int, single_request: bool,
            attack: bool = True, **overrides) -> OnlineCalibrator:
        cal = make_calibrator(prior, prose.gamma, args, **overrides)
        j = 0
        for i in range(n):
            for _ in range(per_round if attack else 0):
                r = j % len(attack_src)
                cal.observe(attack_src.signals[r], int(attack_src.available[r]), 0, greedy, attack_label,
                            1 if single_request else 1_000 + j, True, temperature)
                j += 1
            cal.observe(prose.signals[i], int(prose.available[i]), int(prose.accepted[i]), greedy, victim,
                        None, True, temperature)
        return cal

    def moved(a: OnlineCalibrator, b: OnlineCalibrator, label: str | None) -> dict:
        sa = a.survival(prose.signals, prose.available, temps, [label] * n)
        sb = b.survival(prose.signals, prose.available, temps, [label] * n)
        d = (sa - sb).abs()
        return {"max_abs_change": float(d.max()), "mean_abs_change": float(d[prose.cumulative_labels()[1]].mean())}

    out = {}
    clean = run("prose", "attack", 0, False, attack=False)
    attacked = run("prose", "attack", 5, False)
    out["attack_workload_vs_prose"] = {
        "setup": "5 forced-rejection rounds (label 'attack', a new request id each) per prose round",
        "prose_rounds": n, "attack_rounds": 5 * n, **moved(attacked, clean, "prose"),
        "attack_workload_source": attacked.parameters("attack")["sampled" if not greedy else "greedy"]["source"]}
    clean_default = run(None, None, 0, False, attack=False)
    regime = "greedy" if greedy else "sampled"
    for share in sorted({0.01, args.max_request_share, 1.0}):
        flooded = run(None, None, 1, True, max_request_share=share)
        st = flooded._streams[("default", regime)]
        _, _, _, w = flooded._window(st)
        flood_w = float(w[torch.from_numpy(st.request[: st.filled()] == 1)].sum())
        out[f"single_request_flood_share_{share:g}"] = {
            "setup": "1 forced-rejection round from request id 1 per prose round, both unlabelled (default)",
            "max_request_share": share, "flood_weight_in_window": flood_w, "window_weight": float(w.sum()),
            "request_cap": flooded.request_cap, **moved(flooded, clean_default, None)}
    many = run(None, None, 1, False)
    out["many_request_flood_default"] = {
        "setup": "1 forced-rejection round from a new request id per prose round, both unlabelled (default): "
                 "no cap applies, only the bounded rate (max_step per refit) and the prose half of the window",
        **moved(many, clean_default, None)}
    return out


def plot(checkpoints: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x = [c["rounds"] for c in checkpoints]
    for key, label, style in (("offline_ece", "offline only (fitted on code)", "-"),
                              ("online_ece", "online calibrator", "-"),
                              ("hindsight_ece", "hindsight fit on the whole stream (in-sample floor)", ":")):
        ax.plot(x, [100 * c[key] for c in checkpoints], style, marker="o" if style == "-" else None, markersize=3,
                label=label)
    ax.axhline(100 * TARGET_ECE, color="grey", linestyle="--", linewidth=1, label="3% target")
    ax.set_xlabel("rounds since the switch to prose + math")
    ax.set_ylabel("cumulative ECE, last ≤ 300 rounds (%)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=40, help="prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=300, help="rounds in the prequential ECE window")
    p.add_argument("--every", type=int, default=25, help="rounds between logged ECEs")
    p.add_argument("--shuffle-seed", type=int, default=0)
    p.add_argument("--decay", type=float, default=0.995)
    p.add_argument("--refit-every", type=int, default=25)
    p.add_argument("--max-step", type=float, default=0.25)
    p.add_argument("--min-rounds", type=float, default=50.0)
    p.add_argument("--max-request-share", type=float, default=0.1)
    p.add_argument("--position-ridge", type=float, default=10.0)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    t_start = time.perf_counter()
    command = "python benchmarks/online_calibration.py " + " ".join(
        f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items() if k != "out")

    cache: dict = {}

    def target():
        if "target" not in cache:
            from dspark.api import load_target

            cache["target"] = load_target()  # bfloat16
        return cache["target"]

    def drafter():
        if "drafter" not in cache:
            from dspark.api import load_drafter

            cache["drafter"] = load_drafter("dspark", target(), calibration=None)
        return cache["drafter"]

    plan = (("code", 60, 0), ("prose", 0, 10_000), ("math", 0, 10_000))
    rec = {d: cached_rounds(target, drafter, d, start, args.prompts, args.temperature, args.max_new_tokens,
                            args.batch_size, seed) for d, start, seed in plan}
    recorded_s = {d: record_seconds(d, start, args.prompts, args.temperature, args.max_new_tokens, args.batch_size,
                                    seed) for d, start, seed in plan}
    gamma = max(r.gamma for r in rec.values())
    rec = {d: pad_to(r, gamma) for d, r in rec.items()}
    t_recorded = time.perf_counter()

    offline_map = fit_sequential_temperature(rec["code"])
    offline = Calibration({args.temperature: offline_map}, drafter="dspark", target="bundled")
    both = RoundRecords.concat([rec["prose"], rec["math"]])
    order = torch.randperm(len(both), generator=torch.Generator().manual_seed(args.shuffle_seed))
    stream = RoundRecords(both.signals[order], both.available[order], both.accepted[order], both.greedy[order],
                          [both.domain[i] for i in order.tolist()], both.prompt[order])
    hindsight = Calibration({args.temperature: fit_sequential_temperature(stream)})
    online = make_calibrator(offline, gamma, args)
    pre = prequential(stream, offline, online, hindsight, args.temperature, args.window, args.every)
    cps = pre["checkpoints"]
    at = {c["rounds"]: c for c in cps}
    reach = first_reach(cps, "online_ece", TARGET_ECE)
    offline_fit_ece = pooled_ece(offline.survival(rec["code"].signals, rec["code"].available,
                                                  [args.temperature] * len(rec["code"])), rec["code"])
    frozen = frozen_after(stream, offline, make_calibrator(offline, gamma, args), args.temperature, args.window)
    t_stream = time.perf_counter()
    poison = poisoning(rec["prose"], rec["math"], offline, args.temperature, args)
    t_end = time.perf_counter()

    after300 = [c for c in cps if c["rounds"] >= 300]
    result = {
        "command": command,
        "settings": {**vars(args), "gamma": gamma, "target": "bundled (bfloat16)", "drafter": "dspark (uncalibrated)",
                     "stream": "prose + math held-out prompts [0, N), shuffled arrival, workload None (default)"},
        "rounds": {d: len(r) for d, r in rec.items()},
        "offline_calibration": {"kind": offline_map.kind, "temperatures": offline_map.temperatures,
                                "code_in_sample_ece": offline_fit_ece},
        "prequential": pre,
        "frozen_after_window": frozen,
        "summary": {
            "online_ece_at_300": at.get(300, {}).get("online_ece"),
            "offline_ece_at_300": at.get(300, {}).get("offline_ece"),
            "hindsight_ece_at_300": at.get(300, {}).get("hindsight_ece"),
            "online_stays_below_3pct_from_round": reach,
            "online_ece_max_after_300": max((c["online_ece"] for c in after300), default=None),
            "offline_ece_min_after_300": min((c["offline_ece"] for c in after300), default=None),
            "online_ece_last": cps[-1]["online_ece"], "offline_ece_last": cps[-1]["offline_ece"],
            "target_met": bool(reach is not None and reach <= 300 and
                               all(c["offline_ece"] > TARGET_ECE for c in after300)),
            # the same claim judged on one large sample instead of every noisy 300-round window: online at most
            # 3% at round 300, and on every later round the calibrator as it was at 300 (frozen) at most 3%
            # while the offline-only map is above 3% by more than two prompt-resampled standard errors
            "target_met_on_later_rounds": bool(
                at.get(300, {}).get("online_ece", math.inf) <= TARGET_ECE and frozen
                and frozen["online_frozen_ece"] <= TARGET_ECE
                and frozen["offline_ece"] - 2 * frozen["offline_se"] > TARGET_ECE),
        },
        "online_state": online.state_dict(),
        "poisoning": poison,
        "runtime_s": {"recording_when_first_run": recorded_s, "recording_or_cache": t_recorded - t_start, "stream": t_stream - t_recorded,
                      "poisoning": t_end - t_stream, "total": t_end - t_start},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    plot(cps, out / "ece_vs_rounds.png",
         f"DSpark, T {args.temperature:g}: calibration fitted on code, then prose + math ({len(stream)} rounds)")
    s = result["summary"]

    def pct(v: float | None) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}%"

    lines = [
        f"command: {command}",
        (f"rounds recorded: code {len(rec['code'])} (fit), prose {len(rec['prose'])}, math {len(rec['math'])}; "
        f"gamma {gamma}; temperature {args.temperature:g}"),
        (f"offline STS fit on code: T_k = {[round(t, 3) for t in offline_map.temperatures]}, "
        f"in-sample code ECE {pct(offline_fit_ece)}"),
        (f"online settings: decay {args.decay}, refit every {args.refit_every}, max_step {args.max_step}, "
        f"min_rounds {args.min_rounds}, max_request_share {args.max_request_share}, "
        f"position_ridge {args.position_ridge}"),
        "",
        f"prequential cumulative ECE over the last <= {args.window} rounds (every {args.every} rounds):",
        "  rounds  offline  online  hindsight(in-sample)",
    ]
    lines += [f"  {c['rounds']:6d}  {pct(c['offline_ece']):>7}  {pct(c['online_ece']):>6}  "
              f"{pct(c['hindsight_ece']):>7}" for c in cps]
    lines += [
        "",
        (f"at 300 rounds: offline {pct(s['offline_ece_at_300'])}, online {pct(s['online_ece_at_300'])}, "
        f"hindsight {pct(s['hindsight_ece_at_300'])}"),
        (f"online ECE stays <= 3% from round {s['online_stays_below_3pct_from_round']}; max after 300: "
        f"{pct(s['online_ece_max_after_300'])}; offline min after 300: {pct(s['offline_ece_min_after_300'])}"),
        "whole stream: " + ", ".join(f"{k} {pct(v)}" for k, v in pre["whole_stream_ece"].items()),
        f"all rounds from {args.window} on (one large sample, less noise than a {args.window}-round window): "
        + ", ".join(f"{k} {pct(v)}" for k, v in pre[f"ece_from_round_{args.window}"].items()),
        (f"target judged on every 300-round window (online <= 3% in each from round 300 on, offline above in "
         f"each): {'met' if s['target_met'] else 'NOT met'}"),
        (f"online calibrator frozen after {frozen.get('after_rounds')} rounds, scored on the "
         f"{frozen.get('scored_rounds')} later rounds: online {pct(frozen.get('online_frozen_ece'))} "
         f"± {pct(frozen.get('online_frozen_se'))} (noise floor {pct(frozen.get('online_frozen_floor'))}), "
         f"offline only {pct(frozen.get('offline_ece'))} ± {pct(frozen.get('offline_se'))} (noise floor "
         f"{pct(frozen.get('offline_floor'))}); ± is the standard error over prompts resampled"),
        (f"target judged on those later rounds (online <= 3% at round 300 and frozen there; offline above 3% by "
         f"over two standard errors): {'met' if s['target_met_on_later_rounds'] else 'NOT met'}"),
        "",
        "poisoning (max / mean |change| of the victim's cumulative survival on the prose rounds):",
    ]
    for name, r in poison.items():
        lines.append(f"  {name}: max {r['max_abs_change']:.4f}, mean {r['mean_abs_change']:.4f}  ({r['setup']})")
    lines += ["", (f"runtime: {result['runtime_s']['total']:.0f} s (recording/cache "
              f"{result['runtime_s']['recording_or_cache']:.0f} s, stream {result['runtime_s']['stream']:.0f} s, "
              f"poisoning {result['runtime_s']['poisoning']:.0f} s); recording the rounds on the first run: "
              + ", ".join(f"{d} {'?' if v is None else f'{v:.0f}'} s" for d, v in recorded_s.items()))]
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
