"""Several batches of rows in one model call: their tokens packed end to end, attention per batch.

An engine step that prefills a joining prompt beside the running rows' verify blocks would otherwise run two
target passes, and a pass has a fixed cost that does not depend on its tokens (every layer's kernels launched
once, the weights read once): on the bundled target on 2 CPU cores about 12 ms, most of a 16-row decoding
step. Here both batches (each a `CausalLM` wrapper with its own padded KV cache) go through the model as one
sequence of tokens [1, T]: embeddings, projections, norms, MLPs and the LM head see only real tokens, no
padding. Attention alone is per batch: each layer's new keys and values are scattered into that batch's own
cache exactly as a padded pass of the batch would write them, and its queries attend over that cache under the
same causal, key-validity mask, through the same `sdpa` kernel. A row's outputs are therefore the ones its own
padded pass gives (bit for bit in the tests here; a different GEMM shape may change the last bits elsewhere).

The layers reach the per-batch caches through the cache they are handed: the call passes a `PackedPass` as
the model's cache (its `update` writes each batch's share into that batch's cache), and while the call runs
the attention function registered here (`PACKED`) reads the same pass, whatever mask the model built for the
packed sequence. Outside a packed call that function is `sdpa` with the model's own mask. `enable_packing`
switches a model to it only where that is exact (the model ran `sdpa` and has no sliding-window layers), and
`CausalLM.packs` checks a packed call against padded passes once per model before using it.
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dspark.attention import folds, gqa_attention

PACKED = "dspark_packed"


@dataclass
class PackedGroup:
    """One batch's part of a packed pass.

    cache: the batch's HF cache (appended to by the pass); counts: new tokens per row; width: the padded pass
    width (max count); index: positions of the real tokens in the row-major [rows × width] layout (the packed
    order); mask: [rows, 1, width, slots] which cached and new slots each new token attends to.
    """

    cache: object
    counts: torch.Tensor
    width: int
    index: torch.Tensor
    mask: torch.Tensor
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.counts.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.index.shape[0])

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] in packed order → [rows, width, ...] with zeros at padding."""
        out = packed.new_zeros(self.rows * self.width, *packed.shape[1:])
        out[self.index] = packed
        return out.view(self.rows, self.width, *packed.shape[1:])


class PackedPass:
    """The groups of one packed call: the model's cache for that call (`with` it around the call)."""

    def __init__(self, groups: list[PackedGroup]) -> None:
        self.groups = groups
        self._token = None

    def __enter__(self) -> "PackedPass":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def split(self, states: torch.Tensor) -> list[torch.Tensor]:
        """[1, heads, T, d] in packed order → per group [rows, heads, width, d], padding zero."""
        parts, start = [], 0
        for g in self.groups:
            part = states[0, :, start : start + g.tokens].transpose(0, 1)  # [tokens, heads, d]
            parts.append(g.pad(part).transpose(1, 2))
            start += g.tokens
        return parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each group's keys / values to its own cache (what `packed_attention` reads)."""
        for g, keys, values in zip(self.groups, self.split(key_states), self.split(value_states)):
            g.keys[layer_idx] = g.cache.update(keys, values, layer_idx)
        return key_states, value_states

    # what the model's mask construction asks of a cache (the mask it builds is not used)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


_ACTIVE: ContextVar[PackedPass | None] = ContextVar("dspark_packed_pass", default=None)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """`sdpa` attention; inside a packed call, each group's queries over its own cache, output in packed order."""
    run = _ACTIVE.get()
    if run is None:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    outs = []
    for g, q in zip(run.groups, run.split(query)):
        keys, values = g.keys[module.layer_idx]
        out, _ = _attention(module, q, keys, values, g.mask, dropout, scaling, **kwargs)
        outs.append(out.reshape(g.rows * g.width, *out.shape[2:])[g.index])  # [tokens, heads, d]
    return torch.cat(outs).unsqueeze(0), None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask, dropout: float, scaling: float | None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's `sdpa` attention, or the same with grouped query heads folded where that is faster
    (`dspark.attention`); output [B, n, heads, d]."""
    plain = (kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("sliding_window") is not None or kwargs.get("output_attentions", False)
             or (attention_mask is not None and attention_mask.dtype != torch.bool)
             or (attention_mask is None and query.shape[2] > 1)  # HF may rely on is_causal there
             or not folds(query, key))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = gqa_attention(query, key, value, attention_mask, scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def packed_mask(*args, **kwargs):
    """`sdpa`'s mask; none inside a packed call (each group brings its own)."""
    return None if _ACTIVE.get() is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, packed_mask)


def enable_packing(model: PreTrainedModel) -> bool:
    """Switch `model` to the packed-capable attention where that is exact; return whether it now packs."""
    config = model.config
    if config._attn_implementation == PACKED:
        return True
    layer_types = getattr(config, "layer_types", None) or []
    if config._attn_implementation != "sdpa" or "sliding_attention" in layer_types \
            or getattr(config, "use_sliding_window", False):
        return False
    try:
        model.set_attn_implementation(PACKED)
    except (ValueError, ImportError, AttributeError):
        return False
    return config._attn_implementation == PACKED


def disable_packing(model: PreTrainedModel) -> None:
    """Back to plain `sdpa` (a model whose forward turned out not to take a packed pass)."""
    if model.config._attn_implementation == PACKED:
        model.set_attn_implementation("sdpa")
