"""The one decoding loop: draft, verify in one batched target pass, commit, roll back, feed back.

Target-only decoding, n-gram lookup, draft models and the feature-conditioned drafters all run through
`decode`; a single request is a batch of one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dspark.drafters.base import DraftBlock, Drafter, RoundOutcome
from dspark.sampling import BatchSampling, SamplingParams, make_generator
from dspark.scheduling import CostModel, Scheduler, step_tokens
from dspark.target import CausalLM
from dspark.verify import verify


@dataclass
class RoundStats:
    """One round of one request: how many drafts were verified and how many were accepted.

    available: drafts the block offered (after the token budget) before the scheduler cut it to
    draft_len. signals: the block's survival signals [available][3] when the loop records them.
    """

    draft_len: int
    accepted: int
    available: int | None = None
    signals: list[list[float]] | None = None


@dataclass
class StepInfo:
    """One step of the decoding loop, as measured: what the cost model is fitted and corrected on."""

    batch: int
    tokens: int
    drafted: bool
    seconds: float
    lengths: list[int]
    expected_throughput: float | None = None
    capacity: int | None = None


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
StepCallback = Callable[[StepInfo], None]


def drafter_gamma(drafter: Drafter) -> int:
    """Drafts per round the drafter proposes at most (0 for target-only decoding)."""
    return int(getattr(drafter, "max_drafts", None) or getattr(drafter, "gamma", 0) or 0)


def survival_for(drafter: Drafter, block: DraftBlock, sampling: BatchSampling, temperatures: list[float],
                 signals: torch.Tensor | None = None, online=None):
    """Calibrated survival a [R, γ] of a block: the online calibrator, else the drafter's calibration (or the
    default map), on the block's signals."""
    from dspark.calibration.maps import default_map
    from dspark.calibration.signals import block_signals

    signals = block_signals(block, sampling.greedy) if signals is None else signals
    if signals.shape[1] == 0:  # no row drafted anything (e.g. no n-gram match)
        return torch.zeros(signals.shape[0], 0)
    if online is not None:
        return online.survival(signals, block.lengths.cpu(), temperatures)
    calibration = getattr(drafter, "calibration", None)
    if calibration is None:
        return default_map(block.confidences is not None, signals.shape[1]).survival(signals, block.lengths.cpu())
    return calibration.survival(signals, block.lengths.cpu(), temperatures)


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
) -> list[GenerationResult]:
    """Generate continuations of token-id prompts with speculative decoding; return one result each.

    on_tokens(i, tokens) is called whenever request i commits tokens (for streaming).
    scheduler: how many drafts each request verifies per step (`dspark.scheduling`): "fixed" verifies the
    whole block (the default), "fixed:K", "none", "threshold:θ", "batch-table", "dspark", "dspark-async";
    the last two need `cost_model`. draft_limits[i] caps request i's verified drafts (0: no speculation).
    token_budget caps the query tokens of a step. record_signals keeps each round's survival signals in
    its RoundStats (calibration and scheduler traces); on_step(StepInfo) is called after every step, whose
    measured time also corrects `cost_model` online unless online_cost is False. online_calibration (an
    `OnlineCalibrator`) supplies the survival estimates and learns from every verified prefix.
    """
    _check_inputs(target, prompts, max_new_tokens)
    gamma = drafter_gamma(drafter)
    sched = scheduler if isinstance(scheduler, Scheduler) else Scheduler(scheduler, gamma)
    if sched.needs_cost and cost_model is None:
        raise ValueError(f"scheduler {sched.spec!r} needs a cost model: run `dspark profile` or pass cost_model")
    if draft_limits is not None:
        draft_limits = [int(x) for x in draft_limits]
        if len(draft_limits) != len(prompts) or any(x < 0 for x in draft_limits):
            raise ValueError(f"draft_limits needs one non-negative count per prompt, got {draft_limits}")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget must be a positive number of tokens, got {token_budget}")
    layout = cost_model.layout if cost_model is not None else "padded"
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling settings for {len(prompts)} prompts")
    eos = target.eos_token_ids if eos_token_ids is None else eos_token_ids
    device = target.device
    results = [GenerationResult(prompt_ids=[int(t) for t in p]) for p in prompts]
    seqs = [list(r.prompt_ids) for r in results]
    gens = [make_generator(p.seed, device) for p in params]
    active = list(range(len(prompts)))  # request index of each batch row
    want_features = bool(drafter.feature_layers)
    if want_features and list(target.feature_layers) != list(drafter.feature_layers):
        target.set_feature_layers(drafter.feature_layers)
    start = time.perf_counter()

    # Prefill everything but the last prompt token; that token is the first round's anchor.
    target.reset(len(prompts))
    pre = target.forward([s[:-1] for s in seqs], features=want_features)
    drafter.start(seqs, pre.features)

    while active:
        step_start = time.perf_counter()
        batch_params = BatchSampling.from_params([params[i] for i in active], device)
        batch_gens = [gens[i] for i in active]
        rows_seqs = [seqs[i] for i in active]
        budget = [max_new_tokens - len(results[i].token_ids) - 1 for i in active]
        if draft_limits is not None:
            budget = [min(b, draft_limits[i]) for b, i in zip(budget, active)]
        drafted = gamma > 0 and max(budget) > 0 and sched.wants_drafts(len(active))
        block = drafter.propose(rows_seqs, batch_params, batch_gens) if drafted else DraftBlock.empty(len(active), device)
        block = block.truncate(budget)
        available = block.lengths.tolist()
        plan_theta = plan_capacity = None
        signals = None
        if (record_signals or online_calibration is not None) and drafted:
            from dspark.calibration.signals import block_signals

            signals = block_signals(block, batch_params.greedy)
        if drafted and sched.kind not in ("fixed", "none"):
            survival = None
            if sched.needs_survival:
                survival = survival_for(drafter, block, batch_params, [params[i].temperature for i in active],
                                        signals, online_calibration)
            plan = sched.plan(survival, available, cost_model, token_budget, active)
            block = block.truncate(plan.lengths)
            plan_theta, plan_capacity = plan.expected_throughput, plan.capacity
        elif drafted:
            block = block.truncate(sched.plan(None, available, cost_model, token_budget).lengths)
        lens = block.lengths.tolist()
        drafts = block.tokens.tolist()
        inputs = [[s[-1]] + drafts[r][: lens[r]] for r, s in enumerate(rows_seqs)]
        base_len = target.lengths.clone()
        out = target.forward(inputs, features=want_features)
        width = max(lens) + 1 if lens else 1
        logits = out.logits[:, :width]
        draft_tokens = block.tokens[:, : width - 1]
        if draft_tokens.shape[1] < width - 1:
            draft_tokens = torch.nn.functional.pad(draft_tokens, (0, width - 1 - draft_tokens.shape[1]))
        probs = block.probs[:, : width - 1] if block.probs is not None else None
        res = verify(logits, draft_tokens, block.lengths, probs, batch_params, batch_gens, eos)
        # Keep the anchor and the accepted drafts in the target cache; the new token is the next anchor.
        target.truncate(base_len + 1 + torch.tensor(res.accepted, device=device))
        drafter.observe(RoundOutcome(committed=res.tokens, accepted=res.accepted, features=out.features))
        if online_calibration is not None and signals is not None:
            for r, i in enumerate(active):  # the verified prefix labels positions 1..ℓ (admission read signals only)
                if lens[r] > 0:
                    online_calibration.observe(signals[r, : lens[r]], lens[r], res.accepted[r], params[i].greedy,
                                               request_id=i, temperature=params[i].temperature)
        seconds = time.perf_counter() - step_start
        tokens_in_step = step_tokens(lens, layout)
        if cost_model is not None and online_cost:
            cost_model.observe(len(active), tokens_in_step, seconds, drafted)
        if on_step is not None:
            on_step(StepInfo(len(active), tokens_in_step, drafted, seconds, lens, plan_theta, plan_capacity))

        still = []
        for r, i in enumerate(active):
            room = max_new_tokens - len(results[i].token_ids)
            new = res.tokens[r][:room]
            results[i].token_ids.extend(new)
            seqs[i].extend(new)
            sig = signals[r, : available[r]].tolist() if record_signals and signals is not None else None
            results[i].rounds.append(RoundStats(lens[r], res.accepted[r], available[r], sig))
            if on_tokens is not None and new:
                on_tokens(i, new)
            if any(t in eos for t in new):
                results[i].finish_reason = "stop"
            elif len(results[i].token_ids) < max_new_tokens:
                still.append(r)
        if len(still) < len(active):
            target.select(still)
            drafter.select(still)
            active = [active[r] for r in still]

    elapsed = time.perf_counter() - start
    for r in results:
        r.seconds = elapsed
    return results
