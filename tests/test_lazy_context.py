"""The block drafters queue each round's context and project it only when they draft: the drafts are those of a
drafter that projects every committed token at once, and steps that draft nothing run the drafter's model only
for joining prompts."""
from __future__ import annotations

import dspark
from dspark.api import encode_prompt
from dspark.drafters.base import drafter_gamma
from dspark.drafters.block import BlockDrafter
from dspark.engine import Engine, EngineConfig, Request
from dspark.evaluation.bench import load_eval_prompts
from dspark.sampling import SamplingParams
from dspark.scheduling import Scheduler


class EveryThirdStep(Scheduler):
    """Fixed full blocks, drafted on every third step only (the others decode plainly)."""

    def __init__(self, gamma: int) -> None:
        super().__init__("fixed", gamma)
        self.calls = 0

    def wants_drafts(self, num_rows: int) -> bool:
        self.calls += 1
        return self.calls % 3 == 0


class EagerDrafter(BlockDrafter):
    """Projects every joining prompt and every round's tokens into the context at once."""

    def join(self, prompts, prefill_features) -> None:
        super().join(prompts, prefill_features)
        self._flush()

    def observe(self, outcome) -> None:
        super().observe(outcome)
        self._flush()


def requests(target) -> list[Request]:
    texts = [t for d in ("code", "prose", "math") for t in load_eval_prompts(d, 3)]
    return [Request(encode_prompt(target, t), SamplingParams() if i % 2 else SamplingParams(1.0, seed=i),
                    max_tokens=12 + 5 * i) for i, t in enumerate(texts)]


def run(target, drafter) -> tuple[list[Request], int, list]:
    """The requests run through an engine drafting every third step; the drafter's projections other than
    of joining prompts (which are projected at once); the steps."""
    calls = 0
    project = drafter.model.context_kv

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return project(*args, **kwargs)

    drafter.model.context_kv = counted
    joins = 0
    join = drafter.join

    def counted_join(prompts, features):
        nonlocal joins
        joins += bool(prompts)
        return join(prompts, features)

    drafter.join = counted_join
    try:
        steps: list = []
        engine = Engine(target, drafter, EveryThirdStep(drafter_gamma(drafter)), config=EngineConfig(max_running=4),
                        on_step=steps.append)
        reqs = requests(target)
        engine.run(reqs)
    finally:
        del drafter.model.context_kv
        del drafter.join
    return reqs, calls - joins, steps


def test_lazy_context_drafts_what_an_eager_one_drafts_and_projects_only_to_draft(bundled_target):
    lazy = dspark.load_drafter("dspark", bundled_target, calibration=None)
    eager = EagerDrafter(lazy.model, bundled_target, name="dspark")
    lazy_reqs, lazy_calls, steps = run(bundled_target, lazy)
    eager_reqs, eager_calls, _ = run(bundled_target, eager)
    for a, b in zip(lazy_reqs, eager_reqs):
        assert a.output_ids == b.output_ids
        assert [(r.draft_len, r.accepted) for r in a.rounds] == [(r.draft_len, r.accepted) for r in b.rounds]
    assert sum(r.accepted for req in lazy_reqs for r in req.rounds) > 0  # the drafts were worth something
    drafted = sum(1 for s in steps if s.drafted)
    assert 0 < drafted < len(steps) // 2
    assert lazy_calls <= drafted  # past the prompts, at most one projection per drafting call, none in plain steps
    assert eager_calls >= len(steps)  # the eager drafter projects in every step


def test_a_long_queue_is_projected_without_a_drafting_call(bundled_target, monkeypatch):
    """The queue is bounded: past PENDING_FLUSH tokens in a row it is projected even while nothing drafts."""
    import dspark.drafters.block as block

    monkeypatch.setattr(block, "PENDING_FLUSH", 4)
    lazy = dspark.load_drafter("dspark", bundled_target, calibration=None)
    eager = EagerDrafter(lazy.model, bundled_target, name="dspark")
    lazy_reqs, lazy_calls, steps = run(bundled_target, lazy)
    eager_reqs, _, _ = run(bundled_target, eager)
    assert [r.output_ids for r in lazy_reqs] == [r.output_ids for r in eager_reqs]
    assert [[(s.draft_len, s.accepted) for s in r.rounds] for r in lazy_reqs] == \
        [[(s.draft_len, s.accepted) for s in r.rounds] for r in eager_reqs]
    assert lazy_calls > sum(1 for s in steps if s.drafted)


def test_the_engine_catches_up_just_before_each_drafting_call_only(bundled_target):
    """The queued context is projected in `catch_up`, outside the drafting round the cost model prices, and
    only in steps that draft."""
    events: list[str] = []

    class Recording(BlockDrafter):
        def catch_up(self) -> None:
            events.append("catch_up")
            super().catch_up()

        def propose(self, sequences, sampling, generators):
            events.append("propose")
            return super().propose(sequences, sampling, generators)

    base = dspark.load_drafter("dspark", bundled_target, calibration=None)
    drafter = Recording(base.model, bundled_target, name="dspark")
    steps: list = []
    engine = Engine(bundled_target, drafter, EveryThirdStep(drafter_gamma(drafter)), config=EngineConfig(max_running=4),
                    on_step=steps.append)
    engine.run(requests(bundled_target)[:4])
    drafted = sum(1 for s in steps if s.drafted)
    assert drafted > 0 and events == ["catch_up", "propose"] * drafted
