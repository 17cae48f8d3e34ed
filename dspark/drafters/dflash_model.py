"""The DFlash block-drafting backbone: Qwen3-style layers whose keys/values include the target context.

Target features (hidden states of chosen target layers, concatenated) are projected once,
H_ctx = hidden_norm(fc(features)), and every draft layer applies its own k_proj / v_proj to H_ctx, so
the context enters each layer as extra keys and values ("KV injection"). Only the γ block tokens
([anchor, mask × (γ−1)]) form the hidden stream; they attend bidirectionally to each other and to every
context key. RoPE rotates every key and query at its absolute token position. Parameter names follow
the public DSpark/DFlash checkpoints (`layers.i.self_attn.q_proj`, `fc`, `hidden_norm`, `norm`, ...).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from dspark.attention import gqa_attention


@dataclass
class DFlashConfig:
    """Shape and behaviour of a block drafter (DFlash backbone plus optional DSpark heads).

    slot_convention: "next" (DeepSpec/DSpark: slot k predicts the token after the anchor + k, γ drafts)
    or "self" (z-lab DFlash: slot 0 is discarded, slot j predicts its own position, γ−1 drafts).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 7
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    slot_convention: str = "next"
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.slot_convention not in ("next", "self"):
            raise ValueError(f"slot_convention must be 'next' or 'self', got {self.slot_convention!r}")
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn, got {self.markov_head_type!r}")
        if self.block_size < 1 or (self.slot_convention == "self" and self.block_size < 2):
            raise ValueError(f"block_size {self.block_size} is too small for the {self.slot_convention!r} convention")

    @property
    def num_drafts(self) -> int:
        """Draft tokens per round: γ for the 'next' convention, γ − 1 for 'self'."""
        return self.block_size if self.slot_convention == "next" else self.block_size - 1

    def to_dict(self) -> dict:
        """Plain-dict form for config.json."""
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (Qwen3's, computed in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x / rms(x) * weight: normalized in float32, cast back to x's dtype, then scaled (HF's order)."""
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def derived_tensor(owner: nn.Module, key: str, params: list[torch.Tensor], build) -> torch.Tensor:
    """build(*params): rebuilt on every call while gradients are wanted (it backpropagates into each
    parameter); at inference built once per parameter version and kept on `owner`."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return build(*params)
    version = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
    cache = owner.__dict__.setdefault("_fused", {})
    if key not in cache or cache[key][0] != version:
        cache[key] = (version, build(*[p.detach() for p in params]))
    return cache[key][1]


def fused_weight(owner: nn.Module, key: str, linears: list[nn.Linear]) -> torch.Tensor:
    """The weights of several bias-free linears stacked along the output dim, so one matmul does all."""
    return derived_tensor(owner, key, [m.weight for m in linears], lambda *w: torch.cat(w, 0))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin tables [..., head_dim] for integer positions (HF's rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin tables of every position up to a bound, computed once (grown on demand) and gathered per call.

    Gives exactly `rope_cos_sin`'s values; a drafting round then costs one lookup instead of recomputing
    the frequencies. Not a module buffer, so checkpoints do not change.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, half-negated sin) covering every position in `positions`."""
        key = (positions.device, dtype)
        tables = self.tables.get(key)
        need = int(positions.max()) + 1 if positions.numel() else 0
        if tables is None or need > tables[0].shape[0]:
            size = max(need, 512, 2 * (tables[0].shape[0] if tables is not None else 0))
            cos, sin = rope_cos_sin(torch.arange(size, device=positions.device), self.head_dim, self.theta, dtype)
            half = self.head_dim // 2
            tables = self.tables[key] = (cos, sin, torch.cat([-sin[:, :half], sin[:, half:]], 1))
        return tables

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., head_dim] for integer positions [...] (all >= 0)."""
        cos, sin, _ = self._tables(positions, dtype)
        return cos[positions], sin[positions]

    def rolled(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the half-negated sin [..., head_dim] that `rotate` takes."""
        cos, _, signed_sin = self._tables(positions, dtype)
        return cos[positions], signed_sin[positions]


def project_qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
                kv_heads: int, head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed, rotated queries [R, H, T, hd] and keys [R, KV, T, hd], and values, of inputs x [R, T, *].

    `attn` holds q_proj/k_proj/v_proj (bias-free) and q_norm/k_norm: q, k and v come from one matmul
    over the stacked weights, and q and k are normed and rotated together (tables from `RopeTable.rolled`).
    """
    r, t, _ = x.shape
    h, kv, hd = heads, kv_heads, head_dim
    out = F.linear(x, fused_weight(attn, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]))
    qk = out[..., : (h + kv) * hd].view(r, t, h + kv, hd)
    scale = derived_tensor(attn, "qk_scale", [attn.q_norm.weight, attn.k_norm.weight],
                           lambda q, k: torch.cat([q.expand(h, hd), k.expand(kv, hd)], 0))
    qk = rotate((F.rms_norm(qk, (hd,), eps=eps) * scale).transpose(1, 2), cos, signed_sin)
    v = out[..., (h + kv) * hd :].view(r, t, kv, hd).transpose(1, 2)
    return qk[:, :h], qk[:, h:], v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [R, H, T, hd] by per-row tables cos/sin [R, T, hd] (HF's rotate-half form)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in three kernels: rotate_half(x)·sin = roll(x, hd/2)·signed_sin, the sign folded into the table."""
    return torch.addcmul(x * cos.unsqueeze(1), x.roll(x.shape[-1] // 2, -1), signed_sin.unsqueeze(1))


class DraftMLP(nn.Module):
    """SwiGLU feed-forward block (gate/up/down, no bias)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return down(silu(gate(x)) * up(x)); gate and up run as one matmul."""
        gate, up = F.linear(x, fused_weight(self, "gate_up", [self.gate_proj, self.up_proj])).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DraftAttention(nn.Module):
    """Attention of block queries over [context keys; block keys] with per-head q/k RMSNorm."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor,
        room: bool = False,
    ) -> torch.Tensor:
        """Attend block states x [R, γ, d] to ctx_k/ctx_v [R, KV, T, hd] and the block itself.

        mask: bool [R, 1 or γ, T + γ], True where a query may attend, or None for all keys.
        cos/signed_sin: `RopeTable.rolled`. room: ctx_k / ctx_v are [R, KV, T + γ, hd] whose last γ slots are
        scratch for the block's own keys and values (`ContextCache.rooms`): written there in place instead of
        concatenated, which would copy the whole context every layer.
        """
        r, g, _ = x.shape
        h, kv, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q, bk, bv = project_qkv(self, x, cos, signed_sin, h, kv, hd, self.cfg.rms_norm_eps)
        if room:
            ctx_k[:, :, ctx_k.shape[2] - g:] = bk
            ctx_v[:, :, ctx_v.shape[2] - g:] = bv
            k, v = ctx_k, ctx_v
        else:
            k = torch.cat([ctx_k, bk], dim=2)
            v = torch.cat([ctx_v, bv], dim=2)
        mask = None if mask is None else mask.unsqueeze(1)
        out = gqa_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(r, g, h * hd))


class DraftLayer(nn.Module):
    """Pre-norm Qwen3 decoder block with KV injection."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, signed_sin, ctx_k, ctx_v, mask, room: bool = False) -> torch.Tensor:
        """Return the block states after attention and MLP, with residuals (room: `DraftAttention.forward`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, ctx_k, ctx_v, mask, room)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashBackbone(nn.Module):
    """fc + hidden_norm over target features, N draft layers, final norm. Embedding and LM head are the target's."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        m = len(cfg.target_layer_ids)
        self.fc = nn.Linear(m * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.__dict__["rope"] = RopeTable(cfg.head_dim, cfg.rope_theta)  # rope(positions, dtype); no state dict entry

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) [R, KV, T, hd] of target features [R, T, m*d] at absolute positions [R, T].

        Every layer's k_proj and v_proj run as one matmul; the keys of all layers are normed and rotated
        together.
        """
        cfg = self.cfg
        h_ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, signed_sin = self.rope.rolled(positions, h_ctx.dtype)
        attn = [layer.self_attn for layer in self.layers]
        r, t, _ = h_ctx.shape
        n, kv, hd = len(attn), cfg.num_key_value_heads, cfg.head_dim
        weight = fused_weight(self, "context_kv", [m for a in attn for m in (a.k_proj, a.v_proj)])
        both = F.linear(h_ctx, weight).view(r, t, n, 2, kv, hd)
        k_scale = derived_tensor(self, "context_k_scale", [a.k_norm.weight for a in attn],
                                 lambda *w: torch.stack(w).view(n, 1, hd))
        k = F.rms_norm(both[:, :, :, 0], (hd,), eps=cfg.rms_norm_eps) * k_scale  # [R, T, n, KV, hd]
        k = rotate(k.reshape(r, t, n * kv, hd).transpose(1, 2), cos, signed_sin)  # [R, n*KV, T, hd]
        v = both[:, :, :, 1].reshape(r, t, n * kv, hd).transpose(1, 2)
        return [(k[:, i * kv : (i + 1) * kv], v[:, i * kv : (i + 1) * kv]) for i in range(n)]

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        room: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states [R, γ, d] of the block.

        block_embeds: [R, γ, d] embeddings of [anchor, mask, ...]; positions: [R, γ];
        ctx_kv: per-layer context keys/values [R, KV, T, hd] ([R, KV, T + γ, hd] with room: the last γ slots
        scratch for the block's own, `DraftAttention.forward`); mask: bool [R, 1 or γ, T + γ] or None (all).
        """
        x = block_embeds.to(self.fc.weight.dtype)
        cos, signed_sin = self.rope.rolled(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, signed_sin, k, v, mask, room)
        return self.norm(x)
