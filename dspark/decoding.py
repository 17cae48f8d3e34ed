"""Decode a fixed set of token-id prompts to completion through the engine (`dspark.engine`).

Target-only decoding, n-gram lookup, draft models and the feature-conditioned drafters all run through
the engine's one loop; a single request is a batch of one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dspark.drafters.base import Drafter, drafter_gamma
from dspark.engine import Engine, EngineConfig, Request, RoundStats, StepInfo
from dspark.engine.engine import StepCallback
from dspark.engine.survival import survival_for
from dspark.sampling import SamplingParams
from dspark.scheduling import CostModel, Scheduler
from dspark.target import CausalLM

__all__ = ["GenerationResult", "RoundStats", "StepInfo", "decode", "drafter_gamma", "survival_for"]


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded) and per-round statistics of one request."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    finish_reason: str = "length"
    text: str = ""
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Accepted length τ: tokens committed per round, bonus token included."""
        return len(self.token_ids) / max(1, len(self.rounds))


TokenCallback = Callable[[int, list[int]], None]


def _check_inputs(target: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if not prompts:
        raise ValueError("no prompts given")
    limit = getattr(target.model.config, "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if limit is not None and len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
                f"target's context of {limit} tokens"
            )
        bad = [t for t in p if not 0 <= int(t) < target.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")


@torch.no_grad()
def decode(
    target: CausalLM,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    max_new_tokens: int = 128,
    on_tokens: TokenCallback | None = None,
    eos_token_ids: frozenset[int] | None = None,
    scheduler: str | Scheduler = "fixed",
    cost_model: CostModel | None = None,
    draft_limits: Sequence[int] | None = None,
    token_budget: int | None = None,
    record_signals: bool = False,
    on_step: StepCallback | None = None,
    online_cost: bool = True,
    online_calibration=None,
    workloads: Sequence[str | None] | None = None,
) -> list[GenerationResult]:
    """Generate continuations of token-id prompts with speculative decoding; return one result each.

    on_tokens(i, tokens) is called whenever request i commits tokens (for streaming).
    scheduler: how many drafts each request verifies per step (`dspark.scheduling`): "fixed" verifies the
    whole block (the default), "fixed:K", "none", "threshold:θ", "batch-table", "dspark", "dspark-async";
    the last two need `cost_model`. draft_limits[i] caps request i's verified drafts (0: no speculation).
    token_budget caps the query tokens of a step. record_signals keeps each round's survival signals in
    its RoundStats (calibration and scheduler traces); on_step(StepInfo) is called after every step, whose
    measured time also corrects `cost_model` online unless online_cost is False. online_calibration (an
    `OnlineCalibrator`) supplies the survival estimates and learns from every verified prefix. workloads[i]
    labels request i's workload (e.g. its domain): survival uses that workload's calibration where it has one.
    """
    _check_inputs(target, prompts, max_new_tokens)
    if draft_limits is not None:
        draft_limits = [int(x) for x in draft_limits]
        if len(draft_limits) != len(prompts) or any(x < 0 for x in draft_limits):
            raise ValueError(f"draft_limits needs one non-negative count per prompt, got {draft_limits}")
    if workloads is not None and len(workloads) != len(prompts):
        raise ValueError(f"{len(workloads)} workload labels for {len(prompts)} prompts")
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling settings for {len(prompts)} prompts")
    config = EngineConfig(max_running=len(prompts), max_waiting=len(prompts), token_budget=token_budget,
                          online_cost=online_cost, record_signals=record_signals, detokenize=False)
    engine = Engine(target, drafter, scheduler, cost_model, config, online_calibration, eos_token_ids, on_step)
    requests = [
        Request(list(p), params[i], max_new_tokens, max_draft=None if draft_limits is None else draft_limits[i], seq=i,
                workload=None if workloads is None else workloads[i])
        for i, p in enumerate(prompts)  # seq = the prompt's index: what schedulers and the calibrator key on
    ]
    index = {req.seq: i for i, req in enumerate(requests)}
    start = time.perf_counter()
    for req in requests:
        engine.add(req)
    while engine.has_work:
        for out in engine.step():
            if on_tokens is not None and out.token_ids:
                on_tokens(index[out.request.seq], out.token_ids)
    elapsed = time.perf_counter() - start
    return [
        GenerationResult(prompt_ids=req.prompt_ids, token_ids=req.output_ids, rounds=req.rounds,
                         finish_reason=req.finish_reason or "length", seconds=elapsed)
        for req in requests
    ]
