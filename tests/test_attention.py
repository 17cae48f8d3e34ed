"""Grouped-query attention with folded query heads (`dspark.attention`): the same outputs as repeating the keys."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark.attention import folds, gqa_attention, unfolded
from dspark.target import CausalLM
from tests.conftest import tiny_llama, tiny_qwen3


def _reference(q, k, v, mask):
    """Attention with every key / value head repeated per query head (Hugging Face's `repeat_kv`), in float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)


def _inputs(batch=3, heads=6, kv_heads=2, n=4, slots=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, 16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, slots, 16, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("mask_heads", [None, 1, 6])
def test_folded_attention_matches_repeated_keys(n, mask_heads):
    q, k, v = _inputs(n=n)
    mask = None
    if mask_heads is not None:
        mask = torch.rand(3, mask_heads, n, 11, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[..., 0] = True  # every query sees a key
    assert folds(q, k)
    got = gqa_attention(q, k, v, mask)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), _reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    with unfolded():
        assert not folds(q, k)
        torch.testing.assert_close(gqa_attention(q, k, v, mask), got, atol=1e-5, rtol=1e-5)
    assert folds(q, k)  # the switch is restored on leaving


def test_a_mask_broadcast_over_queries_and_an_additive_mask_fold_too():
    q, k, v = _inputs(n=3)
    keep = torch.rand(3, 1, 1, 11, generator=torch.Generator().manual_seed(2)) > 0.5
    keep[..., -1] = True
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    want = _reference(q, k, v, keep)
    torch.testing.assert_close(gqa_attention(q, k, v, keep).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gqa_attention(q, k, v, additive).double(), want, atol=1e-5, rtol=1e-5)


def test_the_folded_mask_of_one_call_is_not_reused_for_another():
    """Layers of one pass share their mask and the fold is kept; a new mask (even of the same shape) is folded
    afresh, and an unfolded query count is not served a fold made for another."""
    q, k, v = _inputs(n=2)
    first = torch.ones(3, 1, 2, 11, dtype=torch.bool)
    second = first.clone()
    second[:, :, :, 5:] = False
    gqa_attention(q, k, v, first)
    torch.testing.assert_close(gqa_attention(q, k, v, second).double(), _reference(q, k, v, second),
                               atol=1e-5, rtol=1e-5)
    q1 = q[:, :, :1]
    torch.testing.assert_close(gqa_attention(q1, k, v, second[:, :, :1]).double(),
                               _reference(q1, k, v, second[:, :, :1]), atol=1e-5, rtol=1e-5)


def test_equal_heads_do_not_fold():
    q, k, v = _inputs(heads=2, kv_heads=2)
    assert not folds(q, k)
    torch.testing.assert_close(gqa_attention(q, k, v, None).double(), _reference(q, k, v, None),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama])
def test_a_target_gives_the_same_logits_folded_and_unfolded(build):
    """Through the model (packed attention on, GQA 4 over 2): decoding passes of one and of several tokens over a
    cache with rolled-back holes, the first pass without a mask (HF's causal path) included."""
    model = build()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    blocks = [[torch.randint(0, 96, (k,), generator=gen).tolist() for k in (1, 1, 1)],
              [torch.randint(0, 96, (k,), generator=gen).tolist() for k in (5, 2, 4)]]

    def run() -> list[torch.Tensor]:
        lm = CausalLM(model)
        assert lm.packs
        lm.reset(3)
        outs = [lm.forward([[5, 6, 7]] * 3).logits, lm.forward(prompts).logits]
        for block in blocks:
            outs.append(lm.forward(block).logits)
            lm.truncate(lm.lengths - torch.tensor([1, 0, 2]))
        return outs

    folded = run()
    with unfolded():
        plain = run()
    for got, want in zip(folded, plain):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_fold_benchmark_reports_every_cell(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "attention_fold", Path(__file__).resolve().parent.parent / "benchmarks" / "attention_fold.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fold.txt"
    bench.main(["--rows", "2", "--slots", "60", "--queries", "1", "3", "--reps", "1", "--out", str(out)])
    cells = json.loads(out.with_suffix(".json").read_text())["cells"]
    assert [(c["queries"], c["kind"]) for c in cells] == [(q, k) for q in (1, 3) for k in ("ragged", "even", "attn")]
    assert all(c["folded_ms"] > 0 and c["hf_ms"] > 0 for c in cells)
    assert "HF/folded" in out.read_text()
