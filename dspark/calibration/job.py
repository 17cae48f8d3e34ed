"""`dspark calibrate`: record rounds on fitting prompts, fit a survival map, score it on disjoint prompts.

The bundled held-out prompts (120 per domain) are split: the map is fitted on rounds of prompts
[fit_offset, fit_offset + fit_prompts) and scored on rounds of prompts [0, eval_prompts), so the reported
ECE is measured on prompts the fit never saw (`dspark bench` also reads prompts from 0 on).
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
        parts.append(records_from_results(results, temperature, domain))
    return RoundRecords.concat(parts)


def domain_prompts(target: CausalLM, domain: str, start: int, count: int) -> list[list[int]]:
    """Token ids of bundled held-out prompts [start, start + count) of a domain, in the chat template."""
    from dspark.evaluation.bench import load_eval_prompts

    texts = load_eval_prompts(domain, start + count)[start:]
    return [encode_prompt(target, t) for t in texts]


@dataclass
class CalibrationRun:
    """What one temperature's calibration produced."""

    temperature: float
    fitted: SurvivalMap
    before: dict
    after: dict
    fit_rounds: int
    eval_rounds: int


def calibrate_temperature(target: CausalLM, drafter: Drafter, temperature: float, domains: Sequence[str],
                          fit_prompts: int = 40, eval_prompts: int = 40, fit_offset: int = 60,
                          max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0,
                          plot_dir: str | Path | None = None, label: str = "drafter") -> CalibrationRun:
    """Fit the drafter's survival map at one temperature and score it before and after on disjoint prompts."""
    if fit_offset < eval_prompts:
        raise ValueError(f"fit prompts start at {fit_offset} but the report scores prompts 0..{eval_prompts - 1}: "
                         "they would overlap; raise --fit-offset or lower --eval-prompts")
    if fit_offset + fit_prompts > PROMPTS_PER_DOMAIN:
        raise ValueError(f"fit prompts {fit_offset}..{fit_offset + fit_prompts - 1} exceed the "
                         f"{PROMPTS_PER_DOMAIN} held-out prompts per domain")
    fit, held = [], []
    for d in domains:
        fit.append(record_rounds(target, drafter, domain_prompts(target, d, fit_offset, fit_prompts), temperature,
                                 max_new_tokens, batch_size, seed, d))
        held.append(record_rounds(target, drafter, domain_prompts(target, d, 0, eval_prompts), temperature,
                                  max_new_tokens, batch_size, seed + 10_000, d))
    fit_records, eval_records = RoundRecords.concat(fit), RoundRecords.concat(held)
    has_head = bool(torch.isfinite(fit_records.signals[..., 0]).any())
    before_map = default_map(has_head, fit_records.gamma)
    fitted = fit_map(fit_records, has_head)
    before = calibration_report(eval_records, before_map)
    after = calibration_report(eval_records, fitted)
    if plot_dir is not None:
        path = Path(plot_dir) / f"reliability_{label}_T{temperature:g}.png"
        reliability_diagram(eval_records, {"before": before_map, "after": fitted}, path,
                            f"{label}, T {temperature:g}: cumulative survival on held-out rounds")
    return CalibrationRun(temperature, fitted, before, after, len(fit_records), len(eval_records))


def run_calibrate(target: CausalLM, drafter: Drafter, out: str | Path, temperatures: Sequence[float],
                  domains: Sequence[str], label: str, **kw) -> Calibration:
    """Calibrate at each temperature, merge into `out` (keeping its other temperatures), print the tables."""
    from dspark.identity import drafter_id, target_id

    did, tid = drafter_id(drafter), target_id(target)
    maps, metrics = {}, {}
    out = Path(out)
    if out.exists():
        old = Calibration.load(out, did, tid)
        maps.update(old.maps)
        metrics.update(old.metrics)
    for t in temperatures:
        run = calibrate_temperature(target, drafter, t, domains, label=label, **kw)
        maps[float(t)] = run.fitted
        metrics[float(t)] = {"before": run.before, "after": run.after, "fit_rounds": run.fit_rounds,
                             "eval_rounds": run.eval_rounds, "domains": list(domains)}
        print(f"\n{label} at temperature {t:g}: fitted on {run.fit_rounds} rounds, scored on {run.eval_rounds} "
              f"held-out rounds ({run.fitted.kind if hasattr(run.fitted, 'kind') else type(run.fitted).__name__})")
        print(format_report_table(run.before, run.after))
        sys.stdout.flush()
    cal = Calibration(maps, drafter=did, target=tid, metrics=metrics)
    cal.to_json(out)
    return cal
