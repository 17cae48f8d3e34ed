"""`dspark calibrate`: record rounds on fitting prompts, fit a survival map, score it on disjoint prompts.

The bundled held-out prompts (120 per domain) are split: the map is fitted on rounds of prompts
[fit_offset, fit_offset + fit_prompts) and scored on rounds of prompts [0, eval_prompts), so the reported
ECE is measured on prompts the fit never saw (`dspark bench` also reads prompts from 0 on). With more than
one domain, a map per domain is fitted on that domain's fitting rounds as well (a per-workload calibration,
used by requests labelled with the domain) and scored on the domain's held-out rounds beside the pooled map.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dspark.api import encode_prompt
from dspark.calibration.fit import fit_map
from dspark.calibration.maps import Calibration, SurvivalMap, default_map
from dspark.calibration.metrics import calibration_report, format_report_table, reliability_diagram
from dspark.calibration.records import RoundRecords, records_from_results
from dspark.decoding import decode
from dspark.drafters.base import Drafter
from dspark.sampling import SamplingParams
from dspark.target import CausalLM

PROMPTS_PER_DOMAIN = 120


def record_rounds(target: CausalLM, drafter: Drafter, prompts: Sequence[Sequence[int]], temperature: float,
                  max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0, domain: str = "",
                  top_k: int = 0, top_p: float = 1.0) -> RoundRecords:
    """Decode `prompts` verifying whole blocks ("fixed") and return their labelled rounds."""
    parts = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        params = [SamplingParams(temperature, top_k, top_p, seed + start + i) for i in range(len(chunk))]
        results = decode(target, drafter, chunk, params, max_new_tokens, scheduler="fixed", record_signals=True)
        parts.append(records_from_results(results, temperature, domain, first_prompt=start))
    return RoundRecords.concat(parts)


def domain_prompts(target: CausalLM, domain: str, start: int, count: int,
                   texts: Sequence[str] | None = None) -> list[list[int]]:
    """Token ids of prompts [start, start + count) of a domain, in the chat template: of `texts` if given,
    else of the bundled held-out prompts."""
    from dspark.evaluation.bench import load_eval_prompts

    texts = load_eval_prompts(domain, start + count)[start:] if texts is None else texts[start:start + count]
    return [encode_prompt(target, t) for t in texts]


def read_prompt_files(paths: Sequence[str | Path], domains: Sequence[str]) -> dict[str, list[str]]:
    """First user turns per domain of JSONL files with rows {"domain": ..., "turns": [user, ...]} (the corpus
    and eval-prompt format), in file order, duplicates dropped. A missing file, a malformed row or a requested
    domain without prompts raises ValueError naming the file, line or domain."""
    import json

    out: dict[str, list[str]] = {d: [] for d in domains}
    seen: set[tuple[str, str]] = set()
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"prompt file {p} does not exist")
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    domain, user = row["domain"], row["turns"][0]
                except (ValueError, KeyError, IndexError, TypeError):
                    raise ValueError(f"prompt file {p} line {n}: expected a JSON object with \"domain\" and a "
                                     "non-empty \"turns\" list") from None
                if not isinstance(domain, str) or not isinstance(user, str) or not user:
                    raise ValueError(f"prompt file {p} line {n}: \"domain\" and \"turns\"[0] must be strings")
                if domain in out and (domain, user) not in seen:
                    seen.add((domain, user))
                    out[domain].append(user)
    empty = [d for d, texts in out.items() if not texts]
    if empty:
        raise ValueError(f"prompt files {', '.join(map(str, paths))} have no prompts of domain(s) {empty}")
    return out


@dataclass
class CalibrationRun:
    """What one temperature's calibration produced."""

    temperature: float
    fitted: SurvivalMap
    before: dict
    after: dict
    fit_rounds: int
    eval_rounds: int
    workload_maps: dict[str, SurvivalMap]
    after_workload: dict | None
    swapped: dict | None = None  # the same fit with the halves swapped: {"ece": {domain: ...}, "ece_se": {...}}


def calibrate_temperature(target: CausalLM, drafter: Drafter, temperature: float, domains: Sequence[str],
                          fit_prompts: int | None = 40, eval_prompts: int | None = 40, fit_offset: int | None = 60,
                          max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0,
                          plot_dir: str | Path | None = None, label: str = "drafter",
                          records_dir: str | Path | None = None,
                          prompt_texts: dict[str, list[str]] | None = None,
                          method: str = "binned", from_records: str | Path | None = None,
                          greedy_peaks: bool = True) -> CalibrationRun:
    """Fit the drafter's survival map at one temperature and score it before and after on disjoint prompts.

    records_dir: also save the fitting and held-out rounds there (safetensors), to refit or rescore offline.
    prompt_texts: prompts per domain (`read_prompt_files`) instead of the bundled 120 per domain; a domain
    with fewer than fit_offset + fit_prompts of them fits on what it has past the scored ones. With
    prompt_texts and eval_prompts None, each domain's even-numbered prompts are scored and its odd-numbered
    ones fitted (interleaved, since prompt files are often ordered by source).
    method: "binned" (histogram binning on STS / the logistic map) or "sts" (the map alone). from_records: a
    --records-dir folder of an earlier run: refit on its rounds instead of decoding. greedy_peaks False: fit and
    score as if greedy rows had no drafting-distribution peak (`RoundRecords.without_greedy_peaks`); the
    recorded rounds keep them.
    """
    if from_records is not None:
        fit_path, eval_path = records_paths(from_records, label, temperature)
        return fit_and_score(RoundRecords.load(fit_path), RoundRecords.load(eval_path), temperature, plot_dir,
                             label, method, greedy_peaks)
    if eval_prompts is None:
        if prompt_texts is None:
            raise ValueError("eval_prompts is needed with the bundled prompts")
        fit, held = [], []
        for d in domains:
            texts = prompt_texts[d]
            if len(texts) < 2:
                raise ValueError(f"domain {d!r} has {len(texts)} prompt(s): two or more are needed to split")
            fit_texts, held_texts = texts[1::2], texts[0::2]  # interleaved: files are often ordered by source
            fit.append(record_rounds(target, drafter, domain_prompts(target, d, 0, len(fit_texts), fit_texts),
                                     temperature, max_new_tokens, batch_size, seed, d))
            held.append(record_rounds(target, drafter, domain_prompts(target, d, 0, len(held_texts), held_texts),
                                      temperature, max_new_tokens, batch_size, seed + 10_000, d))
        return _finish(fit, held, temperature, plot_dir, label, records_dir, method, greedy_peaks)
    fit_prompts = 40 if fit_prompts is None else fit_prompts
    fit_offset = (eval_prompts if prompt_texts is not None else 60) if fit_offset is None else fit_offset
    if fit_offset < eval_prompts:
        raise ValueError(f"fit prompts start at {fit_offset} but the report scores prompts 0..{eval_prompts - 1}: "
                         "they would overlap; raise --fit-offset or lower --eval-prompts")
    if prompt_texts is None and fit_offset + fit_prompts > PROMPTS_PER_DOMAIN:
        raise ValueError(f"fit prompts {fit_offset}..{fit_offset + fit_prompts - 1} exceed the "
                         f"{PROMPTS_PER_DOMAIN} held-out prompts per domain")
    fit, held = [], []
    for d in domains:
        texts = None if prompt_texts is None else prompt_texts[d]
        if texts is not None and len(texts) <= fit_offset:
            raise ValueError(f"domain {d!r} has {len(texts)} prompts in the prompt files, but fitting starts at "
                             f"prompt {fit_offset}: lower --eval-prompts / --fit-offset or add prompts")
        fit.append(record_rounds(target, drafter, domain_prompts(target, d, fit_offset, fit_prompts, texts),
                                 temperature, max_new_tokens, batch_size, seed, d))
        held.append(record_rounds(target, drafter, domain_prompts(target, d, 0, eval_prompts, texts), temperature,
                                  max_new_tokens, batch_size, seed + 10_000, d))
    return _finish(fit, held, temperature, plot_dir, label, records_dir, method, greedy_peaks)


def _finish(fit: list[RoundRecords], held: list[RoundRecords], temperature: float, plot_dir: str | Path | None,
            label: str, records_dir: str | Path | None, method: str, greedy_peaks: bool = True) -> CalibrationRun:
    fit_records, eval_records = RoundRecords.concat(fit), RoundRecords.concat(held)
    if records_dir is not None:
        Path(records_dir).mkdir(parents=True, exist_ok=True)
        fit_path, eval_path = records_paths(records_dir, label, temperature)
        fit_records.save(fit_path)
        eval_records.save(eval_path)
    return fit_and_score(fit_records, eval_records, temperature, plot_dir, label, method, greedy_peaks)


def records_paths(records_dir: str | Path, label: str, temperature: float) -> tuple[Path, Path]:
    """(fitting, held-out) round files of a drafter label and temperature in a --records-dir folder."""
    folder = Path(records_dir)
    return (folder / f"{label}_T{temperature:g}_fit.safetensors", folder / f"{label}_T{temperature:g}_eval.safetensors")


def fit_and_score(fit_records: RoundRecords, eval_records: RoundRecords, temperature: float,
                  plot_dir: str | Path | None = None, label: str = "drafter", method: str = "binned",
                  greedy_peaks: bool = True) -> CalibrationRun:
    """Fit the pooled map (and one per domain when there are several) and score them on the held-out rounds
    (greedy_peaks False: as if greedy rows had no peak, `RoundRecords.without_greedy_peaks`)."""
    if not greedy_peaks:
        fit_records, eval_records = fit_records.without_greedy_peaks(), eval_records.without_greedy_peaks()
    has_head = bool(torch.isfinite(fit_records.signals[..., 0]).any())
    before_map = default_map(has_head, fit_records.gamma)
    fitted, workload_maps = _fit_maps(fit_records, has_head, method)
    before = calibration_report(eval_records, before_map)
    after = calibration_report(eval_records, fitted)
    after_workload = calibration_report(eval_records, fitted, workload_maps) if workload_maps else None
    swapped = None
    if len(eval_records) and len(fit_records):  # the other direction: fitted on the held-out half, scored on the fit half
        swap_fitted, swap_workload = _fit_maps(eval_records, has_head, method)
        rep = calibration_report(fit_records, swap_fitted, swap_workload or None)
        swapped = {"ece": rep["headline_ece"], "ece_se": rep["ece_se"], "rounds": len(fit_records)}
    if plot_dir is not None:
        path = Path(plot_dir) / f"reliability_{label}_T{temperature:g}.png"
        curves: dict = {"before": before_map, "after": fitted}
        if workload_maps:
            curves["after, per workload"] = (fitted, workload_maps)
        reliability_diagram(eval_records, curves, path,
                            f"{label}, T {temperature:g}: cumulative survival on held-out rounds")
    return CalibrationRun(temperature, fitted, before, after, len(fit_records), len(eval_records),
                          workload_maps, after_workload, swapped)


def _fit_maps(records: RoundRecords, has_head: bool, method: str) -> tuple[SurvivalMap, dict[str, SurvivalMap]]:
    """The pooled map and, with more than one domain, one map per domain."""
    domains = [d for d in records.domains() if d]
    workload_maps: dict[str, SurvivalMap] = {}
    if len(domains) > 1:
        for d in domains:
            workload_maps[d] = fit_map(records.subset([x == d for x in records.domain]), has_head, method)
    return fit_map(records, has_head, method), workload_maps


def format_swapped(run: CalibrationRun) -> str:
    """One line per domain: the shipped fit's held-out ECE, the same fit with the halves swapped, their mean."""
    if run.swapped is None:
        return ""
    shipped = (run.after_workload or run.after)["headline_ece"]
    lines = ["halves swapped (fitted on the held-out rounds, scored on the "
             f"{run.swapped['rounds']} fitting rounds): cumulative ECE (pooled)"]
    for d, value in run.swapped["ece"].items():
        one = shipped.get(d)
        if value is None or one is None:
            continue
        lines.append(f"  {d}: {100 * one:.2f}% held-out, {100 * value:.2f}% swapped "
                     f"(± {100 * (run.swapped['ece_se'].get(d) or 0.0):.2f}), mean {50 * (one + value):.2f}%")
    return "\n".join(lines) + "\n"


def run_calibrate(target: CausalLM, drafter: Drafter, out: str | Path, temperatures: Sequence[float],
                  domains: Sequence[str], label: str, **kw) -> Calibration:
    """Calibrate at each temperature, merge into `out` (keeping its other temperatures), print the tables."""
    from dspark.identity import drafter_id, target_id

    did, tid = drafter_id(drafter), target_id(target)
    maps, metrics = {}, {}
    workload_maps: dict[str, dict[float, SurvivalMap]] = {}
    out = Path(out)
    if out.exists():
        old = Calibration.load(out, did, tid)
        maps.update(old.maps)
        metrics.update(old.metrics)
        workload_maps = {w: dict(m) for w, m in old.workload_maps.items()}
    for t in temperatures:
        run = calibrate_temperature(target, drafter, t, domains, label=label, **kw)
        maps[float(t)] = run.fitted
        for per_t in workload_maps.values():  # this temperature's per-workload maps are replaced
            per_t.pop(float(t), None)
        for w, m in run.workload_maps.items():
            workload_maps.setdefault(w, {})[float(t)] = m
        metrics[float(t)] = {"before": run.before, "after": run.after, "fit_rounds": run.fit_rounds,
                             "eval_rounds": run.eval_rounds, "domains": list(domains)}
        if run.after_workload is not None:
            metrics[float(t)]["after_workload"] = run.after_workload
        if run.swapped is not None:
            metrics[float(t)]["swapped"] = run.swapped
        print(f"\n{label} at temperature {t:g}: fitted on {run.fit_rounds} rounds, scored on {run.eval_rounds} "
              f"held-out rounds ({run.fitted.kind})")
        print(format_report_table(run.before, run.after, run.after_workload))
        print(format_swapped(run))
        sys.stdout.flush()
    workload_maps = {w: m for w, m in workload_maps.items() if m}
    cal = Calibration(maps, drafter=did, target=tid, metrics=metrics, workload_maps=workload_maps)
    cal.to_json(out)
    return cal
