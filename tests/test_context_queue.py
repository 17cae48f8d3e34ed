"""A block drafter queues each round's features and projects them at its next draft: the same context as
projecting every round at once, through rows leaving and joining in between."""
from __future__ import annotations

import torch

import dspark


def _rows(drafter) -> list[list[torch.Tensor]]:
    """Each row's valid context keys of every layer, in slot order."""
    ctx = drafter.ctx
    return [[k[r][:, ctx.valid[r]] for k, _ in ctx.kv] for r in range(ctx.valid.shape[0])]


def test_queued_rounds_project_to_the_same_context_as_eager_ones(bundled_target) -> None:
    lazy = dspark.load_drafter("dspark", bundled_target)
    eager = dspark.load_drafter("dspark", bundled_target)
    dim = len(lazy.feature_layers) * int(bundled_target.model.config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] * n for n in (5, 9, 3)]
    prefill = torch.randn(3, 9, dim, generator=gen)
    for d in (lazy, eager):
        d.join(prompts, prefill)

    def round_(rows: int, counts: list[int]) -> None:
        features = torch.randn(rows, 8, dim, generator=gen)
        c = torch.tensor(counts)
        lazy.observe(dspark.drafters.base.RoundOutcome([[0] * n for n in counts], [n - 1 for n in counts], features))
        eager._append_context(features[:, : max(counts)], c)

    round_(3, [1, 4, 2])
    round_(3, [8, 1, 1])
    assert lazy._pending and len(lazy._pending) == 2
    for d in (lazy, eager):
        d.select([2, 0])  # row 1 leaves: rows from the end fill its place
    round_(2, [3, 5])
    more = torch.randn(1, 6, dim, generator=gen)
    for d in (lazy, eager):
        d.join([[1] * 7], more)  # a row joins with nothing queued
    round_(3, [2, 1, 6])
    lazy._flush()
    assert not lazy._pending
    assert torch.equal(lazy.ctx.lengths, eager.ctx.lengths)
    for got, want in zip(_rows(lazy), _rows(eager)):
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5)


def test_a_round_that_drafts_nothing_costs_the_drafter_no_pass(bundled_target) -> None:
    drafter = dspark.load_drafter("dspark", bundled_target)
    dim = len(drafter.feature_layers) * int(bundled_target.model.config.hidden_size)
    drafter.join([[1] * 4, [1] * 6], torch.randn(2, 6, dim))
    calls = []
    original = drafter.model.context_kv
    drafter.model.context_kv = lambda *a, **k: calls.append(1) or original(*a, **k)
    for _ in range(5):
        drafter.observe(dspark.drafters.base.RoundOutcome([[0], [0]], [0, 0], torch.randn(2, 1, dim)))
    assert calls == []  # queued, not projected
    drafter.propose([[1] * 9, [1] * 11], dspark.sampling.BatchSampling.from_params(
        [dspark.sampling.SamplingParams()] * 2, bundled_target.device), [None, None])
    assert calls == [1]  # five rounds in one pass, before drafting


def test_a_long_run_of_rounds_without_drafts_keeps_the_queue_short_and_the_context_exact(bundled_target) -> None:
    """A long back-off queues at most PENDING_LIMIT rounds (rows leaving and joining re-index every queued round,
    so an unbounded queue made such steps dearer than drafting): the rounds past it are projected in passes of
    PENDING_LIMIT, into the same context as projecting each round at once."""
    lazy = dspark.load_drafter("dspark", bundled_target)
    eager = dspark.load_drafter("dspark", bundled_target)
    limit = lazy.PENDING_LIMIT
    dim = len(lazy.feature_layers) * int(bundled_target.model.config.hidden_size)
    gen = torch.Generator().manual_seed(1)
    prefill = torch.randn(2, 6, dim, generator=gen)
    for d in (lazy, eager):
        d.join([[1] * 4, [1] * 6], prefill)
    calls = []
    original = lazy.model.context_kv
    lazy.model.context_kv = lambda *a, **k: calls.append(1) or original(*a, **k)
    longest = 0
    for i in range(3 * limit + 3):
        counts = [1 + i % 3, 1]
        features = torch.randn(2, 3, dim, generator=gen)
        lazy.observe(dspark.drafters.base.RoundOutcome([[0] * n for n in counts], [n - 1 for n in counts], features))
        eager._append_context(features[:, : max(counts)], torch.tensor(counts))
        longest = max(longest, len(lazy._pending))
    assert longest == limit - 1 and len(calls) == 3  # a pass per `limit` rounds, none per round
    lazy._flush()
    assert torch.equal(lazy.ctx.lengths, eager.ctx.lengths)
    for got, want in zip(_rows(lazy), _rows(eager)):
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5)


def test_a_row_joining_late_reads_its_context_at_its_own_positions(bundled_target) -> None:
    """`join_late`: a request already decoding (its features never captured) gets a context that starts at its
    anchor. Attention reads positions only relative to each other (RoPE), so its block after k observed tokens
    equals the block of a request whose text began where it joined and whose prompt's features are those k."""
    late = dspark.load_drafter("dspark", bundled_target)
    fresh = dspark.load_drafter("dspark", bundled_target)
    dim = len(late.feature_layers) * int(bundled_target.model.config.hidden_size)
    gen = torch.Generator().manual_seed(2)
    before = 40  # tokens the late row decoded before it joined, of which the drafter saw nothing
    late.join([[1] * 5], torch.randn(1, 4, dim, generator=gen))  # another row, there before
    assert late.join_late([[3] * before + [7]])
    assert late.ctx.offsets.tolist() == [0, before] and late.ctx.lengths.tolist() == [4, 0]
    feats, seen = [], 0
    for counts in ([2, 3], [1, 4], [3, 1]):  # (other row, late row) tokens kept per round
        f = torch.randn(2, 4, dim, generator=gen)
        late.observe(dspark.drafters.base.RoundOutcome([[0] * n for n in counts], [n - 1 for n in counts], f))
        feats.append(f[1, : counts[1]])
        seen += counts[1]
    text = [9] * seen + [5]  # the late row's text since it joined, anchor (5) last
    late_block = late.block_hidden([[1] * (5 + 6), [3] * before + text])[1]
    fresh.join([text], torch.cat(feats).unsqueeze(0))
    assert torch.allclose(late_block, fresh.block_hidden([text])[0], atol=1e-4)
    late.select([1])  # rows leave and join around it: its offset goes with it
    assert late.ctx.offsets.tolist() == [before]
    assert torch.allclose(late.block_hidden([[3] * before + text])[0], late_block, atol=1e-5)
