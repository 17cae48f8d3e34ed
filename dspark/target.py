"""A Hugging Face causal LM behind a batched KV cache whose rows advance and roll back independently.

The cache is one HF `DynamicCache` for the whole batch, whose layers append in place into spare capacity
(`dspark.kv_cache`: no copy of the cache per pass). Every forward appends `q = max new tokens` slots to
every row; rows with fewer new tokens pad, and a key-validity mask (passed as the 2-D `attention_mask`)
hides the padding. Explicit per-row `position_ids` keep RoPE at each request's true positions. Rolling a
row back marks its rejected slots invalid; when holes waste too much memory the cache is compacted by
gathering each row's valid slots to the right end. Rows joining the batch are placed with their slots ending
at its right end too, so a short row's text starts far right and attention over it skips the slots before
(`dspark.attention`'s row segments). Causality follows slot order, and a row's valid slots are always in
token order, so attention sees exactly the row's accepted text.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from dspark.attention import segments_for
from dspark.kv_cache import HeadroomLayer, new_cache
from dspark.packed import PackedGroup, PackedPass, disable_packing, enable_packing


@dataclass
class ForwardOutput:
    """Logits [R, q, V] (float32) and, when asked for, concatenated target features [R, q, m*d]."""

    logits: torch.Tensor
    features: torch.Tensor | None


def num_decoder_layers(model: PreTrainedModel) -> int:
    """Return the number of decoder layers of an HF causal LM."""
    return int(model.config.num_hidden_layers)


def check_feature_layers(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Validate target layer ids for feature extraction and return them as a list.

    Ids are 0-based decoder layers (-1 = the embedding output), strictly increasing. The last layer is
    refused: HF's hidden_states[-1] is taken after the final norm, not the raw decoder output.
    """
    ids = [int(i) for i in layer_ids]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"feature layer ids must be strictly increasing, got {ids}")
    for i in ids:
        if i < -1 or i >= num_layers:
            raise ValueError(f"feature layer id {i} is outside [-1, {num_layers - 1}] for a {num_layers}-layer target")
        if i == num_layers - 1:
            raise ValueError(
                f"feature layer id {i} is the target's final layer, whose HF hidden state is post-norm; "
                f"use ids <= {num_layers - 2}"
            )
    return ids


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The decoder layers of an HF causal LM in order (`get_decoder().layers`), or None where the model keeps
    them elsewhere (then features come from `output_hidden_states`)."""
    get = getattr(model, "get_decoder", None)
    try:
        base = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        base = None
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_decoder_layers(model):
        return layers
    return None


@contextmanager
def capturing(layers: torch.nn.ModuleList, ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Record the hidden states `ids` select during one forward: id i the output of decoder layer i, -1 the
    input of layer 0 (what HF's `hidden_states[i + 1]` and `hidden_states[0]` hold). The hooks live for that
    pass only: once `output_hidden_states` has been asked for, HF keeps a capturing hook on every layer and
    attention module, which cost about 2% of every later pass, plain decoding included."""
    store: dict[int, torch.Tensor] = {}

    def keep_input(i: int):
        def hook(module, args, kwargs):
            store[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def keep_output(i: int):
        def hook(module, args, output):
            store[i] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[0].register_forward_pre_hook(keep_input(i), with_kwargs=True) if i == -1
               else layers[i].register_forward_hook(keep_output(i)) for i in ids]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


class CausalLM:
    """Batched incremental decoding over an HF `AutoModelForCausalLM` with per-row rollback."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        feature_layers: Sequence[int] = (),
        compact_slack: int = 64,
    ) -> None:
        self.model = model.eval() if model.training else model  # eval() walks every module: only when needed
        self.tokenizer = tokenizer
        self.feature_layers = check_feature_layers(feature_layers, num_decoder_layers(model))
        self._layers = decoder_layers(model)
        self.compact_slack = compact_slack
        #: most slots a row may span (the padded cache holds batch × width); a pass that would widen the cache
        #: past it compacts first. None: no limit.
        self.max_width: int | None = None
        #: compactions so far, and their measured seconds per cached slot (rows × slots before; exponentially
        #: forgetting, None until one ran): what `compact_price` quotes
        self.compactions = 0
        self.compact_seconds_per_slot: float | None = None
        self.reset(0)

    # ----------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the model's parameters."""
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (the size of every probability vector)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def batch_size(self) -> int:
        """Number of rows in the cache."""
        return int(self.lengths.shape[0])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the generation config, model config and tokenizer."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return frozenset(ids)

    def set_feature_layers(self, layer_ids: Sequence[int]) -> None:
        """Choose which layers' hidden states `forward(..., features=True)` returns."""
        self.feature_layers = check_feature_layers(layer_ids, num_decoder_layers(self.model))

    # ----------------------------------------------------------------- cache control
    def reset(self, batch_size: int) -> None:
        """Drop the cache and start `batch_size` empty rows."""
        self.cache: DynamicCache | None = None
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Keep only the first `lengths[r]` tokens of row r (rolls back rejected drafts)."""
        keep = torch.as_tensor(lengths, dtype=torch.long, device=self.device)
        if bool((keep > self.lengths).any()) or bool((keep < 0).any()):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {keep.tolist()}")
        rank = torch.cumsum(self.valid.long(), dim=1)
        self.valid &= rank <= keep.view(-1, 1)
        self.lengths = keep.clone()
        # Drop trailing slots that no row uses (views, no copy): a batch of one never keeps holes, and
        # later passes attend over fewer slots.
        used = self.valid.any(0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        if width < self.valid.shape[1]:
            self.valid = self.valid[:, :width]
            if self.cache is not None:
                for layer in self.cache.layers:
                    layer.keys = layer.keys[:, :, :width]
                    layer.values = layer.values[:, :, :width]

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the given rows, in that order (finished requests leave the batch)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        self.valid = self.valid[idx]
        self.lengths = self.lengths[idx]
        if self.cache is not None:
            for layer in self.cache.layers:
                if isinstance(layer, HeadroomLayer):
                    layer.select_rows(idx)
                else:
                    layer.keys = layer.keys[idx]
                    layer.values = layer.values[idx]

    def empty_like(self) -> "CausalLM":
        """A new wrapper with no rows over the same model, tokenizer and feature layers (its own cache)."""
        return CausalLM(self.model, self.tokenizer, self.feature_layers, self.compact_slack)

    def take(self, rows: Sequence[int]) -> "CausalLM":
        """Move the given rows (in that order) into a new wrapper and keep the others here, in order."""
        rows = [int(r) for r in rows]
        chosen = set(rows)
        rest = [r for r in range(self.batch_size) if r not in chosen]
        part = self.empty_like()
        part.cache, part.valid, part.lengths = self.cache, self.valid, self.lengths
        if self.cache is not None:  # the part gets its own layer objects; this wrapper keeps the originals
            part.cache = new_cache(self.model.config)
            for mine, theirs in zip(self.cache.layers, part.cache.layers):
                theirs.lazy_initialization(mine.keys, mine.values)
                theirs.keys, theirs.values = mine.keys, mine.values
        part.select(rows)
        self.select(rest)
        return part

    def extend(self, other: "CausalLM") -> None:
        """Append `other`'s rows after this wrapper's rows (new requests join the batch); `other` is emptied.

        Both sides are padded with invalid slots, so every row keeps exactly its own text: the joining rows on
        the left, their slots ending at the cache's right end; these rows, where the joining batch is wider, on
        the right, in place (shifting them would copy the cache; the gap is masked and goes at the next
        compaction, which gathers every row's slots to the right end).
        """
        if other.batch_size == 0:
            return
        width = max(self.valid.shape[1], other.valid.shape[1])
        pad = torch.nn.functional.pad
        valid = torch.cat([pad(self.valid, (0, width - self.valid.shape[1])),
                           pad(other.valid, (width - other.valid.shape[1], 0))], 0)
        if self.cache is not None and all(isinstance(layer, HeadroomLayer) and layer.keys is not None
                                          and layer.keys.dim() == 4 for layer in self.cache.layers):
            # in place where the layers have spare rows and slots: only the joining rows are written
            for i, layer in enumerate(self.cache.layers):
                theirs = other.cache.layers[i] if other.cache is not None else None
                layer.extend_rows(None if theirs is None else theirs.keys, None if theirs is None else theirs.values,
                                  other.batch_size, width, right=True)
        elif self.cache is not None or other.cache is not None:
            ref = self.cache if self.cache is not None else other.cache
            merged = new_cache(self.model.config)
            for i, layer in enumerate(merged.layers):
                k, v = ref.layers[i].keys, ref.layers[i].values
                if isinstance(layer, HeadroomLayer):
                    layer.stack_rows([(None, None, side.batch_size) if side.cache is None else
                                      (side.cache.layers[i].keys, side.cache.layers[i].values, side.batch_size)
                                      for side in (self, other)], width, right=True)
                    continue
                parts_k, parts_v = [], []
                for side in (self, other):
                    if side.cache is None:  # rows that never ran a pass: all slots invalid
                        shape = (side.batch_size, k.shape[1], width, k.shape[3])
                        parts_k.append(k.new_zeros(shape))
                        parts_v.append(v.new_zeros((side.batch_size, v.shape[1], width, v.shape[3])))
                    else:  # the joining rows' slots end at the cache's right end, as `valid` has them
                        sk, sv = side.cache.layers[i].keys, side.cache.layers[i].values
                        gap = (0, 0, 0, width - sk.shape[2]) if side is self else (0, 0, width - sk.shape[2], 0)
                        parts_k.append(pad(sk, gap))
                        parts_v.append(pad(sv, gap))
                keys, values = torch.cat(parts_k, 0), torch.cat(parts_v, 0)
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            self.cache = merged
        self.valid = valid
        self.lengths = torch.cat([self.lengths, other.lengths])
        other.reset(0)

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (requests that have not run a pass yet)."""
        fresh = self.empty_like()
        fresh.reset(count)
        self.extend(fresh)

    @property
    def holes(self) -> int:
        """Slots per row that compaction would drop: the cache's width past its longest row."""
        return int(self.valid.shape[1]) - (int(self.lengths.max()) if self.batch_size else 0)

    def first_slots(self) -> torch.Tensor:
        """Each row's first valid slot (the cache's width for a row with none): where attention over it starts."""
        width = int(self.valid.shape[1])
        if width == 0:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        return torch.where(self.valid.any(dim=1), self.valid.to(torch.int8).argmax(dim=1), width)

    def attended_slots(self) -> float:
        """Slots a query of a row attends over, averaged over rows: from the row's first valid slot to the cache's
        end where attention runs in row segments (`dspark.attention`: packed attention on a CPU, grouped query
        heads), the cache's width otherwise."""
        width = int(self.valid.shape[1])
        config = self.model.config
        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        if not self.batch_size or not (self.packs and segments_for(heads, kv_heads, self.device)):
            return float(width)
        return float(width - self.first_slots().float().mean())

    def compact_price(self) -> float | None:
        """Seconds a compaction of the cache as it is would take, from the ones measured (None: none yet)."""
        if self.compact_seconds_per_slot is None:
            return None
        return self.compact_seconds_per_slot * self.batch_size * int(self.valid.shape[1])

    def compact(self) -> None:
        """Gather every row's valid slots to the left and drop the slots no row needs."""
        if self.cache is None:
            return
        start, slots = time.perf_counter(), self.batch_size * int(self.valid.shape[1])
        self._compact()
        self.compactions += 1
        if slots > 0:
            per_slot = (time.perf_counter() - start) / slots
            last = self.compact_seconds_per_slot
            self.compact_seconds_per_slot = per_slot if last is None else last + 0.3 * (per_slot - last)

    def _compact(self) -> None:
        width = int(self.lengths.max()) if self.batch_size else 0
        # Invalid slots first, then the valid ones (stable, so token order is kept): every row's text ends at the
        # cache's right end, and its first slot is as far right as its length allows (attention over a row
        # starts there: `dspark.attention`'s row segments).
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, self.valid.shape[1] - width:]
        for layer in self.cache.layers:
            if isinstance(layer, HeadroomLayer):
                layer.gather_slots(order)
                continue
            gather = order.view(order.shape[0], 1, width, 1).expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = torch.arange(width, device=self.device).view(1, -1) >= (width - self.lengths).view(-1, 1)

    def _maybe_compact(self) -> None:
        slots = self.valid.shape[1]
        longest = int(self.lengths.max()) if self.batch_size else 0
        if slots - longest > max(self.compact_slack, longest // 2):
            self.compact()

    # ----------------------------------------------------------------- forward
    def _begin_pass(self, new_tokens: Sequence[Sequence[int]]) -> "_Pass":
        """Check and lay out a pass appending `new_tokens[r]` to row r (compacting first where needed)."""
        if len(new_tokens) != self.batch_size:
            raise ValueError(f"got {len(new_tokens)} rows of tokens for a batch of {self.batch_size}")
        self._maybe_compact()
        device = self.device
        counts = torch.tensor([len(t) for t in new_tokens], dtype=torch.long, device=device)
        width = max(1, int(counts.max()) if len(new_tokens) else 1)
        if self.max_width is not None and self.valid.shape[1] + width > self.max_width:
            self.compact()
            if self.valid.shape[1] + width > self.max_width:
                raise ValueError(f"a pass of {width} tokens after rows of up to {self.valid.shape[1]} would span "
                                 f"more than max_width={self.max_width} slots")
        offsets = torch.arange(width, device=device).view(1, -1)
        new_valid = offsets < counts.view(-1, 1)
        mask = torch.cat([self.valid, new_valid], dim=1)
        # A row with no valid key at all would give NaN attention weights that poison the cache;
        # let its (padding) queries see their own slot instead. Those slots stay invalid afterwards.
        empty = ~mask.any(dim=1)
        attn_mask = mask.clone()
        if bool(empty.any()):  # the pass's first slot, which each of the row's queries may see
            attn_mask[empty, self.valid.shape[1]] = True
        if self.cache is None:
            self.cache = new_cache(self.model.config)
        return _Pass(counts, width, new_valid, self.lengths.view(-1, 1) + offsets, mask, attn_mask)

    def _end_pass(self, layout: "_Pass") -> None:
        self.valid = layout.mask
        self.lengths = self.lengths + layout.counts

    def _features(self, out, store: dict[int, torch.Tensor], hooked: bool) -> torch.Tensor:
        """The feature layers' hidden states of a pass, concatenated (from the hooks, or HF's hidden_states)."""
        parts = [store[i] for i in self.feature_layers] if hooked else \
            [out.hidden_states[i + 1] for i in self.feature_layers]
        return torch.cat(parts, dim=-1).float()

    @torch.no_grad()
    def forward(self, new_tokens: Sequence[Sequence[int]], features: bool = False,
                last_logits_only: bool = False) -> ForwardOutput:
        """Append `new_tokens[r]` to row r (lengths may differ, 0 allowed) and return their outputs.

        Output position j of row r is the model's prediction after the row's text up to and including
        new_tokens[r][j]; positions past len(new_tokens[r]) are padding and meaningless. last_logits_only:
        logits [B, 1, V] at each row's last new token only (the vocabulary projection of a prefill's other
        positions is never read); features keep every position.
        """
        layout = self._begin_pass(new_tokens)
        counts, width = layout.counts, layout.width
        ids = torch.zeros(self.batch_size, width, dtype=torch.long)
        for r, toks in enumerate(new_tokens):
            if len(toks):
                ids[r, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
        ids = ids.to(self.device)
        want = features and bool(self.feature_layers)
        hooked = want and self._layers is not None
        with capturing(self._layers, self.feature_layers) if hooked else nullcontext({}) as store:
            out = self.model(
                input_ids=ids,
                attention_mask=layout.attn_mask.long(),
                position_ids=layout.positions,
                cache=self.cache,
                use_cache=True,
                output_hidden_states=want and not hooked,
                **({"logits_to_keep": (counts - 1).clamp(min=0).view(-1, 1)} if last_logits_only else {}),
            )
        self.cache = out.cache
        self._end_pass(layout)
        feats = None
        if want:
            feats = self._features(out, store, hooked)
        return ForwardOutput(logits=out.logits.float(), features=feats)

    @property
    def packs(self) -> bool:
        """Whether `forward_with` runs two wrappers' passes as one model call (else as two passes).

        Decided once per model, on first use: the model must take the packed attention (`dspark.packed`), and a
        packed call on two throwaway rows must give the logits their own padded passes give."""
        flag = getattr(self.model, "_dspark_packs", None)
        if flag is None:
            flag = enable_packing(self.model) and self._packing_agrees()
            if not flag:
                disable_packing(self.model)
            self.model._dspark_packs = flag
        return flag

    def _packing_agrees(self) -> bool:
        probe = ([[1, 2, 3], [4]], [[5, 6]])
        try:
            a, b = self.empty_like(), self.empty_like()
            a.reset(2)
            b.reset(1)
            a.forward([[7], [8, 9]])
            ref_a, ref_b = a.empty_like(), b.empty_like()
            ref_a.reset(2)
            ref_a.forward([[7], [8, 9]])
            ref_b.reset(1)
            want_a, want_b = ref_a.forward(probe[0]).logits, ref_b.forward(probe[1], last_logits_only=True).logits
            got_a, got_b = a._forward_packed(b, probe[0], probe[1], False)
        except Exception:  # a model whose forward does not take a packed pass: two passes instead
            return False
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got_a.logits[0, :3], want_a[0, :3], atol=tol, rtol=tol)
                    and torch.allclose(got_a.logits[1, :1], want_a[1, :1], atol=tol, rtol=tol)
                    and torch.allclose(got_b.logits, want_b, atol=tol, rtol=tol))

    @torch.no_grad()
    def forward_with(self, other: "CausalLM", new_tokens: Sequence[Sequence[int]],
                     other_tokens: Sequence[Sequence[int]], features: bool = False
                     ) -> tuple[ForwardOutput, ForwardOutput]:
        """`self.forward(new_tokens, features)` and `other.forward(other_tokens, features, last_logits_only=True)`
        (a prefill chunk beside the running rows' verify blocks) as one model call where the model packs
        (`packs`), as two passes otherwise. `other` must wrap the same model."""
        if other.model is not self.model:
            raise ValueError("forward_with needs two wrappers of the same model")
        if not self.packs:
            return (self.forward(new_tokens, features=features),
                    other.forward(other_tokens, features=features, last_logits_only=True))
        return self._forward_packed(other, new_tokens, other_tokens, features)

    def _forward_packed(self, other: "CausalLM", new_tokens: Sequence[Sequence[int]],
                        other_tokens: Sequence[Sequence[int]], features: bool
                        ) -> tuple[ForwardOutput, ForwardOutput]:
        mine, theirs = forward_packed([self, other], [new_tokens, other_tokens], [False, True], features)
        return mine, theirs


@torch.no_grad()
def forward_packed(lms: Sequence[CausalLM], tokens: Sequence[Sequence[Sequence[int]]], last_only: Sequence[bool],
                   features: bool = False) -> list[ForwardOutput]:
    """`lms[i].forward(tokens[i], features, last_logits_only=last_only[i])` for every wrapper, as one model call
    (`dspark.packed`: the wrappers' tokens end to end, attention per wrapper over its own cache). The wrappers
    must share one model that packs (`CausalLM.packs`); the first's feature layers are returned for all."""
    lead = lms[0]
    if any(lm.model is not lead.model for lm in lms):
        raise ValueError("a packed call needs wrappers of the same model")
    device = lead.device
    layouts = [lm._begin_pass(toks) for lm, toks in zip(lms, tokens)]
    groups = []
    for lm, lay in zip(lms, layouts):
        slots = lm.valid.shape[1] + lay.width
        causal = torch.arange(slots, device=device).view(1, -1) \
            <= (lm.valid.shape[1] + torch.arange(lay.width, device=device)).view(-1, 1)  # [width, slots]
        mask = (lay.attn_mask.view(lm.batch_size, 1, 1, slots) & causal.view(1, 1, lay.width, slots))
        groups.append(PackedGroup(lm.cache, lay.counts, lay.width, lay.new_valid.reshape(-1).nonzero().squeeze(1),
                                  mask))
    ids = torch.tensor([int(t) for toks in tokens for row in toks for t in row],
                       dtype=torch.long, device=device).view(1, -1)
    positions = torch.cat([lay.positions[lay.new_valid] for lay in layouts]).view(1, -1)
    # logits at every token of a full wrapper's rows, at the last new token of each row of a last-only one
    keep, start = [], 0
    for g, lay, last in zip(groups, layouts, last_only):
        if last:
            ends = start + torch.cumsum(lay.counts, 0) - 1
            keep.append(ends[lay.counts > 0])
        else:
            keep.append(torch.arange(start, start + g.tokens, device=device))
        start += g.tokens
    run = PackedPass(groups)
    want = features and bool(lead.feature_layers)
    hooked = want and lead._layers is not None
    with run, capturing(lead._layers, lead.feature_layers) if hooked else nullcontext({}) as store:
        out = lead.model(input_ids=ids, position_ids=positions, cache=run, use_cache=True,
                         output_hidden_states=want and not hooked, logits_to_keep=torch.cat(keep))
    for lm, lay in zip(lms, layouts):
        lm._end_pass(lay)
    logits = out.logits[0].float()
    packed = lead._features(out, store, hooked)[0] if want else None
    results, kept, start = [], 0, 0
    for lm, g, lay, last in zip(lms, groups, layouts, last_only):
        feats = g.pad(packed[start : start + g.tokens]) if want else None
        if last:
            n = int((lay.counts > 0).sum())
            out_logits = logits.new_zeros(lm.batch_size, 1, logits.shape[-1])
            out_logits[lay.counts > 0, 0] = logits[kept : kept + n]
        else:
            n = g.tokens
            out_logits = g.pad(logits[kept : kept + n])
        results.append(ForwardOutput(out_logits, feats))
        kept += n
        start += g.tokens
    return results


@dataclass
class _Pass:
    """One pass's layout over a wrapper's rows: new tokens per row, padded width, which new slots are real,
    each new token's position, the key-validity mask after the pass and the one attention uses."""

    counts: torch.Tensor
    width: int
    new_valid: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    attn_mask: torch.Tensor
