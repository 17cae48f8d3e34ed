"""One model call for two batches (`CausalLM.forward_with`): the same outputs and caches as two padded passes."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.prefill import fused_prefill_width
from dspark.packed import PACKED
from dspark.target import CausalLM
from tests.conftest import tiny_llama, tiny_qwen3


def _batches(model, seed: int, features: tuple[int, ...] = (0, 1)) -> tuple[CausalLM, CausalLM]:
    """A running batch with rolled-back holes and a prefilling batch part-way through its prompts."""
    gen = torch.Generator().manual_seed(seed)
    main, side = CausalLM(model, feature_layers=features), CausalLM(model, feature_layers=features)
    main.reset(4)
    main.forward([torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 3, 14, 6)])
    main.forward([torch.randint(0, 96, (k,), generator=gen).tolist() for k in (4, 1, 0, 3)])
    main.truncate(main.lengths - torch.tensor([2, 0, 0, 1]))
    side.reset(3)
    side.forward([torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 2, 0)])
    return main, side


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_call_gives_each_batch_what_its_own_pass_gives(build, dtype):
    model = build().to(dtype)
    gen = torch.Generator().manual_seed(5)
    verify_blocks = [torch.randint(0, 96, (k,), generator=gen).tolist() for k in (1, 4, 0, 8)]
    chunks = [torch.randint(0, 96, (k,), generator=gen).tolist() for k in (7, 0, 3)]
    main, side = _batches(model, 1)
    want_main = main.forward(verify_blocks, features=True)
    want_side = side.forward(chunks, features=True, last_logits_only=True)
    main2, side2 = _batches(model, 1)
    assert main2.packs and model.config._attn_implementation == PACKED
    got_main, got_side = main2.forward_with(side2, verify_blocks, chunks, features=True)
    # the same computation but for GEMM shapes (a token's row in a matmul of T rows, not of rows x width):
    # equal up to the last bits (bit for bit in most cells here)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for r, block in enumerate(verify_blocks):
        n = len(block)
        torch.testing.assert_close(got_main.logits[r, :n], want_main.logits[r, :n], **tol)
        torch.testing.assert_close(got_main.features[r, :n], want_main.features[r, :n], **tol)
    for r, chunk in enumerate(chunks):
        if chunk:
            torch.testing.assert_close(got_side.logits[r], want_side.logits[r], **tol)
            torch.testing.assert_close(got_side.features[r, : len(chunk)], want_side.features[r, : len(chunk)], **tol)
    assert not got_side.logits[1].any()  # a row fed nothing this pass
    for a, b in ((main, main2), (side, side2)):
        assert torch.equal(a.valid, b.valid) and torch.equal(a.lengths, b.lengths)
    # the caches hold the same keys in the same slots: the next (ordinary) passes agree too
    nxt = [[3], [4, 5], [6], [7]]
    torch.testing.assert_close(main.forward(nxt).logits, main2.forward(nxt).logits, **tol)
    torch.testing.assert_close(side.forward([[1], [2], [3]]).logits, side2.forward([[1], [2], [3]]).logits, **tol)


def test_a_model_that_cannot_pack_runs_two_passes_with_the_same_outputs():
    model = tiny_qwen3()
    model.set_attn_implementation("eager")
    main, side = _batches(model, 2)
    assert not main.packs and model.config._attn_implementation == "eager"
    ref_main, ref_side = _batches(model, 2)
    got_main, got_side = main.forward_with(side, [[1], [2, 3], [], [4]], [[5, 6], [7], [8]])
    want_main = ref_main.forward([[1], [2, 3], [], [4]])
    want_side = ref_side.forward([[5, 6], [7], [8]], last_logits_only=True)
    assert torch.equal(got_main.logits, want_main.logits) and torch.equal(got_side.logits, want_side.logits)
    with pytest.raises(ValueError, match="same model"):
        main.forward_with(CausalLM(tiny_qwen3()), [[1]] * 4, [])


def test_a_fused_chunk_feeds_as_much_as_the_token_budget_allows():
    assert fused_prefill_width([24]) == 24
    assert fused_prefill_width([300, 20], 256) == 236  # 236 + 20 tokens: the budget exactly
    assert fused_prefill_width([300, 20], 256, cap=50) == 50
    assert fused_prefill_width([50] * 40, 16) == 1  # at least one token per row
    for todo, budget in (([7, 90, 33, 5], 64), ([400], 128), ([3, 3, 3], 100)):
        w = fused_prefill_width(todo, budget)
        fed = lambda width: sum(min(t, width) for t in todo)  # noqa: E731
        assert fed(w) <= budget and (w == max(todo) or fed(w + 1) > budget)
    assert fused_prefill_width([]) == 0 and fused_prefill_width([10], cap=0) == 0


def test_serve_switches_fused_prefill_with_its_flag() -> None:
    from dspark.cli import build_parser
    from dspark.serving.cli import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).fuse_prefill is True
    assert engine_config(parse(["serve", "--no-fuse-prefill"])).fuse_prefill is False
