"""Attention in row segments (`dspark.attention.row_segments`) and the right-aligned cache layout it relies on:
the same outputs as one call over every row, through the kernel, a model and the engine."""
from __future__ import annotations

import pytest
import torch

import dspark.attention as attention
from dspark.attention import gqa_attention, one_fold_kept, row_segments, segment_cost, unsegmented
from dspark.target import CausalLM
from tests.conftest import tiny_qwen3
from tests.test_attention import _reference


def test_rows_are_split_where_a_kernel_call_pays():
    # two long rows then two short ones over 400 slots: a split saves 2 × 350 masked pairs
    assert row_segments([0, 10, 350, 360], 400, call_slots=100) == [(0, 2, 0), (2, 4, 350)]
    # the same saving is not worth a call that costs more
    assert row_segments([0, 10, 350, 360], 400, call_slots=1000) == [(0, 4, 0)]
    # rows starting together stay one run, over the slots from their first
    assert row_segments([300, 300, 300], 400, call_slots=0) == [(0, 3, 300)]
    # a long row after short ones starts its own run, and the next short row another
    assert row_segments([350, 0, 350], 400, call_slots=10) == [(0, 1, 350), (1, 2, 0), (2, 3, 350)]
    assert row_segments([5], 10) == [(0, 1, 5)]
    # the cost counts the calls: rows in order of where they start split into fewer runs than mixed ones
    assert segment_cost([0, 459, 81, 440], 480, call_slots=200) == 480 + 21 + 399 + 40 + 3 * 200
    assert segment_cost([0, 81, 440, 459], 480, call_slots=200) == 2 * 480 + 2 * 40 + 200


@pytest.mark.parametrize("n", [1, 3])
def test_segmented_attention_matches_one_call(monkeypatch, n):
    """Rows whose attended slots start at different places (holes inside too): each row's output is what one
    call over every slot gives, bool and additive masks alike."""
    monkeypatch.setattr(attention, "SEGMENT_CALL_SLOTS", 1)
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, slots = 5, 6, 2, 40
    q = torch.randn(batch, heads, n, 16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, slots, 16, generator=gen) for _ in range(2))
    first = torch.tensor([0, 30, 31, 5, 35])
    keep = torch.arange(slots).view(1, -1) >= first.view(-1, 1)
    keep[1, 33] = False  # a hole
    keep = keep.view(batch, 1, 1, slots).expand(batch, 1, n, slots).clone()
    runs = row_segments(first.tolist(), slots, call_slots=1)
    assert len(runs) > 1
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    want = _reference(q, k, v, keep)
    for mask in (keep, additive):
        torch.testing.assert_close(gqa_attention(q, k, v, mask).double(), want, atol=1e-5, rtol=1e-5)
        with unsegmented():
            torch.testing.assert_close(gqa_attention(q, k, v, mask).double(), want, atol=1e-5, rtol=1e-5)


def test_masks_of_a_packed_pass_are_folded_once_each(monkeypatch):
    """A packed pass alternates its groups' masks at every layer, and layers pass per-call views of one mask: each
    mask is folded, and its segments chosen, once per pass, and every call still gets its own mask's output."""
    monkeypatch.setattr(attention, "SEGMENT_CALL_SLOTS", 1)
    chosen = []
    monkeypatch.setattr(attention, "row_segments", lambda *a, **k: chosen.append(a) or row_segments(*a, **k))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 6, 2, 16, generator=gen)
    k, v = (torch.randn(4, 2, 30, 16, generator=gen) for _ in range(2))
    masks = []
    for first in ([0, 20, 21, 25], [10, 0, 28, 5]):
        keep = torch.arange(30).view(1, -1) >= torch.tensor(first).view(-1, 1)
        masks.append(keep.view(4, 1, 30).expand(4, 2, 30).clone())  # [B, n, S]; layers add the head axis
    def three_layers():
        for _ in range(3):  # three layers, two groups
            for mask in masks:
                view = mask.unsqueeze(1)  # a new tensor object per call, as the drafters' layers make
                torch.testing.assert_close(gqa_attention(q, k, v, view).double(), _reference(q, k, v, view),
                                           atol=1e-5, rtol=1e-5)

    three_layers()
    assert len(chosen) == 2
    chosen.clear()
    with one_fold_kept():  # the comparison switch: one mask kept, by its object, misses at every call
        three_layers()
    assert len(chosen) == 6


def test_joins_and_compactions_align_rows_to_the_right():
    """A joining row's slots end at the cache's right end, and a compaction gathers every row's slots there."""
    lm = CausalLM(tiny_qwen3())
    lm.reset(2)
    lm.forward([[5] * 12, [6] * 9])
    other = lm.empty_like()
    other.reset(1)
    other.forward([[7] * 4])
    lm.extend(other)
    assert lm.valid[2].tolist() == [False] * 8 + [True] * 4
    lm.forward([[1, 2, 3], [4], [5, 6]])
    lm.truncate(lm.lengths - torch.tensor([2, 0, 1]))
    lm.compact()
    width = int(lm.lengths.max())
    assert lm.valid.shape[1] == width
    for row, length in enumerate(lm.lengths.tolist()):
        assert lm.valid[row].tolist() == [False] * (width - length) + [True] * length


def _decode(model) -> list[torch.Tensor]:
    """Prefill, joins of short rows beside long ones, drafted passes with rollbacks and a compaction."""
    gen = torch.Generator().manual_seed(4)
    lm = CausalLM(model)
    assert lm.packs
    lm.reset(2)
    outs = [lm.forward([torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 33)]).logits]
    for size in (3, 6):
        other = lm.empty_like()
        other.reset(1)
        other.forward([torch.randint(0, 96, (size,), generator=gen).tolist()])
        lm.extend(other)
    for step in range(4):
        block = [torch.randint(0, 96, (k,), generator=gen).tolist() for k in (4, 1, 3, 2)]
        outs.append(lm.forward(block).logits)
        lm.truncate(lm.lengths - torch.tensor([2, 0, 1, 1]))
        if step == 1:
            lm.compact()
    return outs


def test_a_model_gives_the_same_logits_with_and_without_segments(monkeypatch):
    monkeypatch.setattr(attention, "SEGMENT_CALL_SLOTS", 1)
    model = tiny_qwen3()
    seen = []
    real = attention.row_segments
    monkeypatch.setattr(attention, "row_segments", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    segmented = _decode(model)
    assert any(len(runs) > 1 for runs in seen)
    with unsegmented():
        plain = _decode(model)
    for got, want in zip(segmented, plain):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)



def test_the_segments_benchmark_reports_every_cell(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "attention_segments", Path(__file__).resolve().parent.parent / "benchmarks" / "attention_segments.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "segments.txt"
    bench.main(["--rows", "4", "--long", "60", "--short", "10", "--queries", "1", "2", "--reps", "1",
                "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(c["rows"], c["queries"]) for c in report["cells"]] == [(4, 1), (4, 2)]
    assert all(c["segmented_pairs"] <= c["pairs"] and c["segmented_ms"] > 0 for c in report["cells"])
    assert report["call_us"] != 0 and "a call costs" in out.read_text()


def test_serve_sorts_rows_unless_told_not_to():
    from dspark.cli import build_parser
    from dspark.serving.cli import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).sort_rows is True
    assert engine_config(parse(["serve", "--no-row-segments"])).sort_rows is False
