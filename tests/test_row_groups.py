"""Rows split into padded groups by length (`dspark.row_groups`): the same outputs as one padded cache."""
from __future__ import annotations

import pytest
import torch

from dspark.engine import Engine, EngineConfig, Request
from dspark.row_groups import GROUP_SLOTS, RowGroups
from dspark.sampling import SamplingParams
from dspark.target import CausalLM
from tests.conftest import tiny_llama, tiny_qwen3


def _rows(model, lengths, seed=0) -> CausalLM:
    """A wrapper of prefilled rows (what the engine moves into the batch after prefill)."""
    gen = torch.Generator().manual_seed(seed)
    lm = CausalLM(model)
    lm.reset(len(lengths))
    lm.forward([torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths])
    return lm


def test_a_long_row_opens_a_group_of_its_own_and_short_rows_stay_together():
    model = tiny_qwen3()
    groups = RowGroups(CausalLM(model))
    groups.extend(_rows(model, [5, 9, 7]), reach=[40, 44, 42])
    assert [lm.batch_size for lm in groups.groups] == [3]
    groups.extend(_rows(model, [30, 6], seed=1), reach=[40 + GROUP_SLOTS, 41])  # widening 3 rows costs more
    assert [lm.batch_size for lm in groups.groups] == [4, 1]
    assert groups._group.tolist() == [0, 0, 0, 1, 0]
    assert groups.lengths.tolist() == [5, 9, 7, 30, 6]
    groups.extend(_rows(model, [4], seed=2), reach=[30])
    assert groups._group.tolist() == [0, 0, 0, 1, 0, 0]


def test_one_group_only_while_the_model_does_not_pack_or_when_asked():
    model = tiny_qwen3()
    groups = RowGroups(CausalLM(model), max_groups=1)
    groups.extend(_rows(model, [5, 9]), reach=[10, 10 + 10 * GROUP_SLOTS])
    assert [lm.batch_size for lm in groups.groups] == [2]
    with pytest.raises(ValueError, match="max_groups"):
        RowGroups(CausalLM(model), max_groups=0)


def test_a_long_row_that_came_first_is_moved_out_once_short_rows_outweigh_a_group():
    """Placement alone would keep short rows beside a long one that joined first; the rebalance moves the rows
    of the cheaper side (here the long one) once the split saves more than a group costs, and only then."""
    model = tiny_qwen3()
    one, two = RowGroups(CausalLM(model), max_groups=1), RowGroups(CausalLM(model))
    for rg in (one, two):
        rg.extend(_rows(model, [20]), reach=[600])
        for k in range(3):  # each short one alone is cheaper beside the long row than in a group of its own
            rg.extend(_rows(model, [4 + k], seed=k), reach=[40])
    assert two._group.tolist() == [0, 0, 0, 0] and two.moves == 0  # 4 x 600 against 3 x 40 + 600 + a group
    for rg in (one, two):
        rg.extend(_rows(model, [7], seed=5), reach=[40])  # 5 x 600 against 4 x 40 + 600 + a group: it pays
    assert sorted(lm.batch_size for lm in two.groups) == [1, 4] and two.moves >= 1
    assert len(set(two._group[1:].tolist())) == 1 and two._group[0] != two._group[1]
    blocks = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    want, got = one.forward(blocks).logits, two.forward(blocks).logits
    for r, block in enumerate(blocks):
        torch.testing.assert_close(got[r, : len(block)], want[r, : len(block)], atol=1e-5, rtol=1e-5)
    assert two.lengths.tolist() == one.lengths.tolist() == [22, 5, 8, 7, 9]
    moves = two.moves
    two.extend(_rows(model, [5], seed=6), reach=[41])
    assert two.moves == moves  # already split: nothing moves


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama])
def test_grouped_rows_give_what_one_padded_cache_gives(build):
    """Passes with and without a prefill chunk beside them, rollbacks, rows leaving and joining: every row's
    logits and features equal those of the same rows in one cache, and the lengths follow."""
    model = build()
    gen = torch.Generator().manual_seed(4)
    one = RowGroups(CausalLM(model, feature_layers=(0, 1)), max_groups=1)
    two = RowGroups(CausalLM(model, feature_layers=(0, 1)))
    lengths, reach = [6, 20, 4, 9], [10, 20 + 2 * GROUP_SLOTS, 10, 12]
    for rg in (one, two):
        rg.extend(_rows(model, lengths, seed=9), reach=reach)
    assert [lm.batch_size for lm in two.groups] == [3, 1] and two._group.tolist() == [0, 1, 0, 0]

    def step(blocks, side_tokens=None):
        outs = []
        for rg in (one, two):
            if side_tokens is None:
                outs.append(rg.forward(blocks, features=True))
            else:
                side = CausalLM(model, feature_layers=(0, 1))
                side.reset(len(side_tokens))
                outs.append(rg.forward_with(side, blocks, side_tokens, features=True)[0])
        for r, block in enumerate(blocks):
            n = len(block)
            torch.testing.assert_close(outs[1].logits[r, :n], outs[0].logits[r, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[1].features[r, :n], outs[0].features[r, :n], atol=1e-5, rtol=1e-5)
        assert one.lengths.tolist() == two.lengths.tolist()

    def rand_blocks(counts):
        return [torch.randint(0, 96, (k,), generator=gen).tolist() for k in counts]

    step(rand_blocks([3, 1, 4, 2]))
    for rg in (one, two):
        rg.truncate(rg.lengths - torch.tensor([2, 0, 3, 1]))
    step(rand_blocks([1, 2, 1, 1]), side_tokens=rand_blocks([5, 3]))
    for rg in (one, two):
        rg.select([3, 1, 0])  # a row leaves, the rest change places
    assert two._group.tolist() == [0, 1, 0]
    step(rand_blocks([2, 1, 3]))
    for rg in (one, two):
        rg.extend(_rows(model, [3, 25], seed=11), reach=[8, 25 + 2 * GROUP_SLOTS])
    assert [lm.batch_size for lm in two.groups] == [3, 2]
    step(rand_blocks([1, 1, 2, 1, 3]))
    assert two.slots < one.slots  # the short rows attend over fewer slots


def test_the_engine_serves_a_long_prompt_among_short_ones_in_two_groups_with_target_only_greedy_output(
        bundled_target):
    """Greedy output of every request equals its output with one cache (itself tested against target-only
    decoding), while the long prompt sits in a group of its own for part of the run."""
    from dspark.api import encode_prompt, load_drafter
    from dspark.drafters.base import drafter_gamma
    from dspark.scheduling import Scheduler

    drafter = load_drafter("dspark", bundled_target)
    drafter.prepare()
    long = "def f(x):\n" + "    x = x + 1\n" * 60
    short = ("The sea is", "def add(a, b):", "1 + 1 =", "Once upon a time", "import os", "Dear Sir,", "x = [", "2 * 3")
    prompts = [encode_prompt(bundled_target, p) for p in (*short[:3], long, *short[3:])]

    def run(groups: int):
        engine = Engine(bundled_target, drafter, Scheduler("fixed:3", drafter_gamma(drafter)), None,
                        EngineConfig(row_groups=groups))
        ids, outs, layouts = [], {}, set()
        for i, prompt in enumerate(prompts):
            ids.append(engine.add(Request(prompt, SamplingParams(temperature=0.0), max_tokens=40 + i)).request_id)
        while engine.has_work:
            for out in engine.step():
                outs.setdefault(out.request.request_id, []).extend(out.token_ids)
            layouts.add(tuple(lm.batch_size for lm in engine.rows.groups))
        return [outs[i] for i in ids], layouts

    single, single_layouts = run(1)
    grouped, layouts = run(2)
    assert all(len(layout) == 1 for layout in single_layouts)
    assert any(len(layout) == 2 and min(layout) > 0 for layout in layouts), layouts
    assert grouped == single
