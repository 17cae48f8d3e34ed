"""The DFlash backbone's fused inference kernels compute exactly the plain per-module math.

The backbone runs q/k/v (and every layer's context k/v, and gate/up) as single matmuls over stacked
weights and norms/rotates q and k together. A reference written op by op from the same parameters
(separate projections, per-head norms, repeated KV heads) must give the same context K/V, block
states and gradients.
"""
import torch
from torch.nn import functional as F

from dspark.drafters.block import DSparkModel
from dspark.drafters.dflash_model import RopeTable, apply_rope, rope_cos_sin, rotate
from tests.training_fixtures import tiny_block_config


def rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_context_kv(model, features, positions):
    cfg = model.cfg
    h_ctx = rms(model.fc(features), model.hidden_norm.weight, cfg.rms_norm_eps)
    cos, sin = model.rope(positions, h_ctx.dtype)
    r, t, _ = h_ctx.shape
    out = []
    for layer in model.layers:
        a = layer.self_attn
        k = rms(a.k_proj(h_ctx).view(r, t, -1, cfg.head_dim), a.k_norm.weight, cfg.rms_norm_eps).transpose(1, 2)
        v = a.v_proj(h_ctx).view(r, t, -1, cfg.head_dim).transpose(1, 2)
        out.append((apply_rope(k, cos, sin), v))
    return out


def reference_forward(model, x, positions, ctx_kv, mask):
    cfg = model.cfg
    h, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = model.rope(positions, x.dtype)
    r, g, _ = x.shape
    for layer, (ck, cv) in zip(model.layers, ctx_kv):
        a = layer.self_attn
        y = rms(x, layer.input_layernorm.weight, eps)
        q = apply_rope(rms(a.q_proj(y).view(r, g, h, hd), a.q_norm.weight, eps).transpose(1, 2), cos, sin)
        k = apply_rope(rms(a.k_proj(y).view(r, g, -1, hd), a.k_norm.weight, eps).transpose(1, 2), cos, sin)
        v = a.v_proj(y).view(r, g, -1, hd).transpose(1, 2)
        k, v = torch.cat([ck, k], 2), torch.cat([cv, v], 2)
        rep = h // k.shape[1]
        att = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask.unsqueeze(1)
        )
        x = x + a.o_proj(att.transpose(1, 2).reshape(r, g, h * hd))
        y = rms(x, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        x = x + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
    return rms(x, model.norm.weight, eps)


def make_inputs(model, seed=0):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    rows, ctx, g = 2, 9, cfg.block_size
    feats = torch.randn(rows, ctx, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    ctx_pos = torch.arange(ctx).expand(rows, -1)
    x = torch.randn(rows, g, cfg.hidden_size, generator=gen)
    positions = ctx + torch.arange(g).expand(rows, -1)
    mask = torch.ones(rows, g, ctx + g, dtype=torch.bool)
    mask[1, :, 6:ctx] = False  # row 1 has padding slots in its context
    mask[0, 2:, ctx:] = torch.rand(g - 2, g, generator=gen) > 0.3  # arbitrary per-query masks
    mask[0, 2:, ctx + 2] = True
    return feats, ctx_pos, x, positions, mask


def randomized_model(**kw) -> DSparkModel:
    torch.manual_seed(3)
    model = DSparkModel(tiny_block_config(num_hidden_layers=2, **kw)).float()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a swapped q/k norm weight would show
            p.add_(0.1 * torch.randn_like(p))
    return model


def test_fused_inference_matches_reference():
    model = randomized_model().eval()
    assert model.cfg.num_attention_heads != model.cfg.num_key_value_heads  # GQA path exercised
    feats, ctx_pos, x, positions, mask = make_inputs(model)
    with torch.no_grad():
        ctx = model.context_kv(feats, ctx_pos)
        ref_ctx = reference_context_kv(model, feats, ctx_pos)
        for (k, v), (rk, rv) in zip(ctx, ref_ctx):
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
        out = model(x, positions, ctx, mask)
        ref = reference_forward(model, x, positions, ref_ctx, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_pass_writing_its_block_into_scratch_slots_after_the_context_matches_concatenation():
    """`room=True`: the context comes with γ scratch slots (`ContextCache.rooms`) that each layer fills with the
    block's own keys and values in place of `torch.cat`; the states are the same and the context is untouched."""
    model = randomized_model().eval()
    feats, ctx_pos, x, positions, mask = make_inputs(model)
    g = x.shape[1]
    with torch.no_grad():
        ctx = model.context_kv(feats, ctx_pos)
        want = model(x, positions, ctx, mask)
        rooms = []
        for k, v in ctx:  # buffers wider than the context, as a layer's headroom is
            rk, rv = k.new_full((*k.shape[:2], k.shape[2] + g + 5, k.shape[3]), float("nan")), v.new_full(
                (*v.shape[:2], v.shape[2] + g + 5, v.shape[3]), float("nan"))
            rk[:, :, : k.shape[2]], rv[:, :, : v.shape[2]] = k, v
            rooms.append((rk[:, :, : k.shape[2] + g], rv[:, :, : v.shape[2] + g]))
        got = model(x, positions, rooms, mask, room=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for (k, v), (rk, rv) in zip(ctx, rooms):
        assert torch.equal(rk[:, :, : k.shape[2]], k) and torch.equal(rv[:, :, : v.shape[2]], v)


def test_fused_weights_follow_in_place_updates():
    """The stacked weights cached at inference are rebuilt after an optimizer step changes a weight."""
    model = randomized_model().eval()
    feats, ctx_pos, x, positions, mask = make_inputs(model)
    with torch.no_grad():
        before = model(x, positions, model.context_kv(feats, ctx_pos), mask)
        model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        model.layers[0].mlp.up_proj.weight.mul_(0.5)
        after = model(x, positions, model.context_kv(feats, ctx_pos), mask)
        ref = reference_forward(model, x, positions, reference_context_kv(model, feats, ctx_pos), mask)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, ref, atol=1e-5, rtol=1e-5)


def test_fused_training_gradients_match_reference():
    model = randomized_model()
    feats, ctx_pos, x, positions, mask = make_inputs(model, seed=1)
    weight = torch.randn(x.shape[0], x.shape[1], x.shape[2])

    def grads(forward, context):
        model.zero_grad()
        (forward(model, x, positions, context(model, feats, ctx_pos), mask) * weight).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused = grads(lambda m, *a: m(*a), lambda m, *a: m.context_kv(*a))
    ref = grads(reference_forward, reference_context_kv)
    assert set(fused) == set(ref) and any(n.endswith("k_norm.weight") for n in fused)
    for name in ref:
        torch.testing.assert_close(fused[name], ref[name], atol=1e-4, rtol=1e-4, msg=name)


def test_rope_table_gives_the_computed_values_and_grows():
    table = RopeTable(head_dim=16, theta=10000.0)
    for positions in (torch.tensor([[0, 5, 511]]), torch.tensor([[3, 700], [1500, 2]])):  # the second one grows it
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = table(positions, dtype)
            ref_cos, ref_sin = rope_cos_sin(positions, 16, 10000.0, dtype)
            assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert table.tables[(torch.device("cpu"), torch.float32)][0].shape[0] >= 1501


def test_rolled_rotation_equals_rotate_half():
    """`rotate` with `RopeTable.rolled` tables is HF's rotate-half RoPE (`apply_rope` with plain tables)."""
    table = RopeTable(head_dim=16, theta=10000.0)
    positions = torch.tensor([[0, 7, 300], [5, 1, 2]])
    x = torch.randn(2, 3, 3, 16)  # [R, H, T, hd]
    cos, signed_sin = table.rolled(positions, torch.float32)
    torch.testing.assert_close(rotate(x, cos, signed_sin), apply_rope(x, *table(positions, torch.float32)))
    assert torch.equal(signed_sin[..., 8:], table(positions, torch.float32)[1][..., 8:])
    assert torch.equal(signed_sin[..., :8], -table(positions, torch.float32)[1][..., :8])
