"""Greedy identity: every drafter reproduces target-only greedy decoding token for token (float32)."""
import pytest
import torch

from dspark.decoding import decode
from dspark.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from dspark.sampling import SamplingParams
from dspark.target import CausalLM
from tests.conftest import tiny_qwen3


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    # repeat a motif so the n-gram drafter finds matches
    motif = torch.randint(0, vocab, (4,), generator=g).tolist()
    return [(motif * 8)[: n // 2] + torch.randint(0, vocab, (n - n // 2,), generator=g).tolist() for n in lengths]


def drafters_for(target: CausalLM, draft: CausalLM):
    return {
        "ngram": NgramDrafter(gamma=4),
        "draft-model": DraftModelDrafter(draft, gamma=3),
        "self-draft": DraftModelDrafter(CausalLM(target.model), gamma=5),
    }


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_identity_random_models(arch, qwen3_target, llama_target):
    target = qwen3_target if arch == "qwen3" else llama_target
    draft = CausalLM(tiny_qwen3(layers=1, hidden=32, seed=7))
    prompts = random_prompts([5, 1, 11, 3], 96)
    reference = decode(target, NoDrafter(), prompts, max_new_tokens=40)
    for name, drafter in drafters_for(target, draft).items():
        batched = decode(target, drafter, prompts, max_new_tokens=40)
        assert [r.token_ids for r in batched] == [r.token_ids for r in reference], name
        single = decode(target, drafter, prompts[2:3], max_new_tokens=40)
        assert single[0].token_ids == reference[2].token_ids, name
    assert len(reference[0].token_ids) == 40


def bundled_feature_drafters(target):
    """The zoo's DFlash / DSpark / EAGLE-3 drafters that are present."""
    import dspark
    from dspark.api import BUNDLED_DRAFTERS
    from dspark.zoo import bundled_drafter_path

    names = [n for n in BUNDLED_DRAFTERS if n != "draft-model" and (bundled_drafter_path(n) / "config.json").exists()]
    return [(n, dspark.load_drafter(n, target)) for n in names]


def test_greedy_identity_bundled(bundled_target, bundled_draft):
    tok = bundled_target.tokenizer
    texts = ["Write a Python function that reverses a list.", "What is a tuple?",
             "Tom buys 3 boxes of 12 pencils. How many pencils does he have?", "def parse_header(line):"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
               for t in texts]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    reference = decode(bundled_target, NoDrafter(), ids, max_new_tokens=48)
    drafters = [("ngram", NgramDrafter(4)), ("draft-model", DraftModelDrafter(bundled_draft, 4))]
    # every drafter's drafts do get accepted (measured τ here: n-gram 1.27, draft model 2.39, the others 3.2-3.7)
    least_tau = {"ngram": 1.1, "draft-model": 1.8}
    for name, drafter in drafters + bundled_feature_drafters(bundled_target):
        batched = decode(bundled_target, drafter, ids, max_new_tokens=48)
        assert [r.token_ids for r in batched] == [r.token_ids for r in reference], name
        single = decode(bundled_target, drafter, ids[:1], max_new_tokens=48)
        assert single[0].token_ids == reference[0].token_ids, name
        tau = sum(len(r.token_ids) for r in batched) / sum(len(r.rounds) for r in batched)
        assert tau > least_tau.get(name, 2.5), (name, tau)


def test_sampled_decoding_is_reproducible_and_batch_independent(qwen3_target):
    prompts = random_prompts([6, 9], 96)
    draft = DraftModelDrafter(CausalLM(tiny_qwen3(layers=1, hidden=32, seed=7)), gamma=3)
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=10, seed=12)]
    a = decode(qwen3_target, draft, prompts, params, max_new_tokens=30)
    b = decode(qwen3_target, draft, prompts, params, max_new_tokens=30)
    c = decode(qwen3_target, draft, prompts[1:], params[1:], max_new_tokens=30)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[1].token_ids == c[0].token_ids


def test_eos_and_max_new_tokens(qwen3_target):
    prompts = random_prompts([4], 96)
    ref = decode(qwen3_target, NoDrafter(), prompts, max_new_tokens=20)[0].token_ids
    eos = ref[5]
    first = ref.index(eos)
    out = decode(qwen3_target, NgramDrafter(4), prompts, max_new_tokens=20, eos_token_ids=frozenset({eos}))[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    out = decode(qwen3_target, NgramDrafter(4), prompts, max_new_tokens=7)[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    assert sum(r.accepted + 1 for r in out.rounds) >= 7
