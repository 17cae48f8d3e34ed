"""EAGLE-3 baseline: lossless in the loop, and TTT training sees exactly what drafting sees."""
import torch

from dspark.decoding import decode
from dspark.drafters import NoDrafter
from dspark.drafters.dflash_model import apply_rope, rope_cos_sin
from dspark.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model
from dspark.sampling import BatchSampling, SamplingParams
from dspark.target import CausalLM
from dspark.training.block_objective import target_pass
from dspark.training.eagle3_objective import eagle3_loss, ttt_logits, ttt_targets
from tests.conftest import tiny_qwen3


def setup():
    tm = tiny_qwen3(layers=4)
    cfg = Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=96, target_layer_ids=[0, 1, 2], ttt_length=4)
    torch.manual_seed(0)
    return tm, Eagle3Model(cfg)


def test_eagle3_is_lossless_batched():
    tm, model = setup()
    target = CausalLM(tm)
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
    ref = decode(target, NoDrafter(), prompts, max_new_tokens=30)
    out = decode(target, Eagle3Drafter(model, target), prompts, max_new_tokens=30)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert max(s.draft_len for r in out for s in r.rounds) == 4


def test_eagle3_cache_appends_in_place_across_rounds():
    """Rounds write the draft layer's K/V into spare capacity (no copy of the cache per step), and output stays
    the target's."""
    tm, model = setup()
    target = CausalLM(tm)
    drafter = Eagle3Drafter(model, target)
    buffers = []
    observe = drafter.observe

    def watch(outcome):
        observe(outcome)
        buffers.append(drafter.cache._kbuf)

    drafter.observe = watch
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    ref = decode(target, NoDrafter(), prompts, max_new_tokens=24)
    out = decode(target, drafter, prompts, max_new_tokens=24)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    rounds = len(buffers)
    assert rounds >= 5 and len({id(b) for b in buffers}) <= 2  # re-homed at most once after the first pass


def test_ttt_steps_match_drafting_steps():
    tm, model = setup()
    target = CausalLM(tm, feature_layers=[0, 1, 2])
    ids = torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(3))
    p = 11  # anchor position
    feats, _ = target_pass(tm, ids, [0, 1, 2])
    with torch.no_grad():
        train_logits = ttt_logits(model, tm, ids, feats, 3)
    drafter = Eagle3Drafter(model, target, gamma=1)
    target.reset(1)
    drafter.start([ids[: p + 1].tolist()], target.forward([ids[:p].tolist()], features=True).features)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0)], "cpu")
    block = drafter.propose([ids[: p + 1].tolist()], sampling, [torch.Generator()])
    torch.testing.assert_close(block.probs[0, 0], torch.softmax(train_logits[0][p - 1], -1), atol=1e-5, rtol=1e-4)
    # chain two more steps with the true tokens, as TTT's teacher forcing does
    target.reset(1)
    drafter.start([ids[: p + 1].tolist()], target.forward([ids[:p].tolist()], features=True).features)
    counts = torch.tensor([p])
    with torch.no_grad():
        out = drafter._step(model.project(torch.cat(drafter.pending_feats[0]).unsqueeze(0)), torch.tensor([drafter.pending_toks[0]]), counts)
        hidden = out[:, -1:]
        for j in (1, 2):
            hidden = drafter._step(hidden, ids[p + j].view(1, 1), torch.tensor([1]))
            logits = drafter.lm_head(model.norm(hidden[0, 0])).float()
            torch.testing.assert_close(logits, train_logits[j][p - 1], atol=1e-4, rtol=1e-4)


def test_ttt_supervises_the_first_answer_token_from_the_header():
    """The row whose input token is the prompt's last token (the first round's anchor) and whose label is the
    first answer token is supervised at step 0; rows whose label is a prompt token are not."""
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    tok_idx, valid = ttt_targets(mask, 0)
    assert tok_idx.tolist() == [1, 2, 3, 4, 5, 6]
    assert valid.tolist() == [False, False, True, True, True, True]  # row 2: token 3 (header), label 4 (answer)
    assert ttt_targets(mask, 1)[1].tolist() == [False, True, True, True, True, False]


def test_eagle3_loss_trains():
    tm, model = setup()
    ids = torch.randint(0, 90, (30,), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(30, dtype=torch.long)
    mask[5:] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss, stats = eagle3_loss(model, tm, ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert stats["accept_rate"].shape == (4,)


def test_fused_qkv_matches_separate_projections():
    """q/k/v from one stacked matmul, q and k normed and rotated together, equal the op-by-op math."""
    _, model = setup()
    attn = model.layers[0].self_attn
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    cfg = model.cfg
    x = torch.randn(2, 5, 2 * cfg.hidden_size)
    positions = torch.arange(5).view(1, -1) + torch.tensor([[3], [9]])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)

    def ref(proj, norm, heads):
        y = proj(x).view(2, 5, heads, cfg.head_dim)
        if norm is not None:
            y = norm.weight * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return y.transpose(1, 2)

    with torch.no_grad():
        q, k, v = attn.qkv(x, positions)
        torch.testing.assert_close(q, apply_rope(ref(attn.q_proj, attn.q_norm, cfg.num_attention_heads), cos, sin))
        torch.testing.assert_close(k, apply_rope(ref(attn.k_proj, attn.k_norm, cfg.num_key_value_heads), cos, sin))
        torch.testing.assert_close(v, ref(attn.v_proj, None, cfg.num_key_value_heads))



def test_rounds_without_drafts_queue_pairs_that_the_next_draft_feeds_as_if_fed_each_round():
    """Rounds that draft nothing (a back-off) queue their (feature, token) pairs per row, a chunk per round; the
    next draft feeds them all at once into the same cache, so its first slot's q equals that of a drafter that
    drafted (and so fed) after every round."""
    from dspark.drafters.base import RoundOutcome

    tm, model = setup()
    target = CausalLM(tm)
    lazy, eager = Eagle3Drafter(model, target), Eagle3Drafter(model, target)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    target.set_feature_layers(lazy.feature_layers)
    target.reset(2)
    feats = target.forward([p[:-1] for p in prompts], features=True).features
    for d in (lazy, eager):
        d.start(prompts, feats)
    seqs = [list(p) for p in prompts]
    greedy = BatchSampling.from_params([SamplingParams()] * 2, "cpu")
    gen = torch.Generator().manual_seed(0)
    rounds = ([2, 1], [1, 3], [3, 2], [1, 1])  # tokens committed per row and round
    for i, counts in enumerate(rounds):
        committed = [torch.randint(1, 90, (n,), generator=gen).tolist() for n in counts]
        outcome = RoundOutcome(committed, [n - 1 for n in counts], torch.randn(2, 3, feats.shape[-1], generator=gen))
        lazy.observe(outcome)
        eager.observe(outcome)
        for s, c in zip(seqs, committed):
            s.extend(c)
        if i + 1 < len(rounds):  # the eager drafter drafts each round (feeding its pairs); its drafts are dropped
            eager.propose(seqs, greedy, [None, None])
    assert [len(f) for f in lazy.pending_feats] == [5, 5]  # the prompt's chunk and four rounds'
    sampled = BatchSampling.from_params([SamplingParams(temperature=1.0)] * 2, "cpu")
    got = lazy.propose(seqs, sampled, [torch.Generator().manual_seed(i) for i in range(2)])
    want = eager.propose(seqs, sampled, [torch.Generator().manual_seed(i) for i in range(2)])
    assert torch.equal(lazy.lengths, eager.lengths)
    torch.testing.assert_close(got.probs[:, 0], want.probs[:, 0], atol=1e-5, rtol=1e-4)
