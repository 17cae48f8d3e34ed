"""The batched KV cache: uneven appends, rollback, row selection and compaction match fresh forwards."""
import pytest
import torch

from dspark.target import CausalLM, check_feature_layers, decoder_layers
from tests.conftest import tiny_llama, tiny_qwen3


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama])
def test_uneven_appends_and_rollback_match_fresh_forward(build):
    model = build()
    lm = CausalLM(model, compact_slack=4)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 1, 3, 12)]
    lm.reset(4)
    lm.forward(seqs)
    for step in range(6):
        new = [torch.randint(0, 96, (k,), generator=gen).tolist() for k in ((1, 4, 0, 3), (2, 0, 5, 1))[step % 2]]
        out = lm.forward(new)
        for r in range(4):
            if new[r]:
                ref = fresh_logits(model, seqs[r] + new[r])[-len(new[r]):]
                torch.testing.assert_close(out.logits[r, : len(new[r])], ref, atol=1e-4, rtol=1e-4)
        # reject the second half of every row's new tokens
        keep = [len(seqs[r]) + len(new[r]) // 2 for r in range(4)]
        seqs = [(seqs[r] + new[r])[: keep[r]] for r in range(4)]
        lm.truncate(keep)
    assert lm.lengths.tolist() == [len(s) for s in seqs]
    lm.select([3, 0])
    out = lm.forward([[5, 6], [7]])
    torch.testing.assert_close(out.logits[0, :2], fresh_logits(model, seqs[3] + [5, 6])[-2:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, :1], fresh_logits(model, seqs[0] + [7])[-1:], atol=1e-4, rtol=1e-4)


def test_compaction_keeps_logits():
    model = tiny_qwen3()
    lm = CausalLM(model, compact_slack=10**6)
    lm.reset(2)
    lm.forward([[1, 2, 3, 4, 5], [6, 7]])
    lm.truncate([2, 2])
    lm.forward([[8, 9, 10], []])
    before = lm.forward([[11], [12]]).logits
    lm.truncate([5, 2])  # drop the probe tokens again
    lm.compact()
    assert lm.valid.shape[1] == 5 and lm.valid.sum().item() == 7
    after = lm.forward([[11], [12]]).logits
    torch.testing.assert_close(after[:, 0], before[:, 0], atol=1e-5, rtol=1e-5)


def test_rollback_after_rejection_bundled(bundled_target):
    """After a rejection the next round's logits equal a fresh forward over the accepted text."""
    lm = bundled_target
    tok = lm.tokenizer
    text = tok("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]
    lm.reset(1)
    lm.forward([text[:-1]])
    lm.forward([[text[-1], 11, 12, 13, 14]])  # anchor + 4 drafts
    lm.truncate([len(text) + 1])  # one draft accepted
    out = lm.forward([[99]])
    ref = fresh_logits(lm.model, text + [11, 99])[-1]
    torch.testing.assert_close(out.logits[0, 0], ref, atol=1e-4, rtol=1e-4)


def test_features_refuse_final_layer():
    model = tiny_qwen3(layers=4)
    assert check_feature_layers([0, 2], 4) == [0, 2]
    with pytest.raises(ValueError, match="final layer"):
        CausalLM(model, feature_layers=[1, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        check_feature_layers([2, 1], 4)


def tiny_gpt2(layers: int = 4):
    """GPT-2 keeps its blocks in transformer.h, not get_decoder().layers: features come from hidden_states."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=100, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_gpt2])
def test_features_are_the_selected_hidden_states(build):
    model = build(layers=4)
    assert (decoder_layers(model) is None) == (build is tiny_gpt2)
    lm = CausalLM(model, feature_layers=[-1, 1])
    lm.reset(1)
    out = lm.forward([[1, 2, 3]], features=True)
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.features[0], torch.cat([hs[0][0], hs[2][0]], -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama])
def test_feature_passes_leave_no_hooks_behind(build):
    """Features come from hooks that live for their pass only: later passes (plain decoding) run hook-free,
    and HF never installs its capturing hooks on every layer, which stay for good once installed."""
    model = build(layers=4)
    assert decoder_layers(model) is not None
    lm = CausalLM(model, feature_layers=[-1, 0, 2])
    lm.reset(2)
    first = lm.forward([[1, 2, 3], [4, 5]], features=True)
    second = lm.forward([[6], [7]], features=True)
    lm.forward([[8], [9]])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not getattr(model, "_output_capturing_hooks_installed", False)
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([[1, 2, 3, 6]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[0][0], hs[1][0], hs[3][0]], -1)
    torch.testing.assert_close(first.features[0], want[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second.features[0, 0], want[3], atol=1e-5, rtol=1e-5)


def test_rollback_drops_trailing_slots():
    """Slots rejected by every row leave the cache, so a batch of one never attends over holes."""
    model = tiny_qwen3()
    lm = CausalLM(model, compact_slack=10**6)
    lm.reset(1)
    lm.forward([[1, 2, 3, 4]])
    for step in range(5):
        lm.forward([[5, 6, 7, 8]])
        lm.truncate([int(lm.lengths[0]) - 2])
        assert lm.valid.shape[1] == int(lm.lengths[0]) and bool(lm.valid.all())
        assert all(layer.keys.shape[2] == lm.valid.shape[1] for layer in lm.cache.layers)
    text = [1, 2, 3, 4] + [5, 6] * 5
    torch.testing.assert_close(lm.forward([[9]]).logits[0, 0], fresh_logits(model, text + [9])[-1], atol=1e-4, rtol=1e-4)
    lm.reset(2)  # with two rows only the columns both rows dropped go
    lm.forward([[1, 2, 3], [4, 5, 6]])
    lm.forward([[7, 8, 9], [1, 2]])
    lm.truncate([4, 3])
    assert lm.valid.shape[1] == 4 and lm.valid.sum().item() == 7
    out = lm.forward([[5], [6]]).logits
    torch.testing.assert_close(out[0, 0], fresh_logits(model, [1, 2, 3, 7, 5])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1, 0], fresh_logits(model, [4, 5, 6, 6])[-1], atol=1e-4, rtol=1e-4)
