"""Block drafters that see the target: DFlash (parallel block) and DSpark (+ sequential and confidence heads).

One round: the block [anchor, mask × (γ−1)] at positions p..p+γ−1 attends to the draft context cache
(projected target features of every accepted token before the anchor) in one parallel pass; the
drafts are then sampled left to right, each slot's logits corrected by the sequential head from the
token sampled at the slot before. After verification the features of the anchor and the accepted
drafts are queued for the context cache (projected into it by the next round that drafts, every queued
round in one pass); the bonus token becomes the next anchor.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.drafters.base import DraftBlock, Drafter, RoundOutcome
from dspark.drafters.context_cache import ContextCache
from dspark.drafters.dflash_model import DFlashBackbone, DFlashConfig
from dspark.drafters.heads import ConfidenceHead, MarkovHead, build_sequential_head
from dspark.sampling import (BatchSampling, argmax_last, filter_logits, greedy_onehot, greedy_peaks,
                             probs_from_sampling_logits, row_uniforms, sample_inverse_cdf, sampling_logits)
from dspark.target import CausalLM


class DSparkModel(DFlashBackbone):
    """DFlash backbone plus the optional `markov_head` (vanilla, gated or rnn) and `confidence_head`."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg)
        self.markov_head = build_sequential_head(cfg.markov_head_type, cfg.vocab_size, cfg.hidden_size, cfg.markov_rank)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            rank = cfg.markov_rank if (cfg.confidence_head_with_markov and cfg.markov_rank > 0) else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size, rank)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor | None:
        """W1[x_{k−1}] for the confidence head, or None when it does not use the Markov embedding."""
        if self.markov_head is None or self.confidence_head is None:
            return None
        if self.confidence_head.proj.in_features == self.cfg.hidden_size:
            return None
        return self.markov_head.markov_w1(prev)


MARKOV_TABLE_MAX_BYTES = 256 * 2**20  # a float32 [V, V] Markov bias table up to V = 8192
MARKOV_TABLE_FILL_FRACTION = 32  # once 1/32 of its rows are computed one by one, compute the rest at once


def _loop_sampling(sampling: BatchSampling) -> tuple[torch.Tensor, bool, bool]:
    """What sampling_logits does, hoisted out of a per-slot loop: the divisor [R, 1], whether any row
    divides by a temperature other than 1, and whether any row filters by top-k / top-p."""
    temp = sampling.divisor.view(-1, 1)
    scale = not bool((temp == 1.0).all())
    filtered = not (bool((sampling.top_k == 0).all()) and bool((sampling.top_p >= 1.0).all()))
    return temp, scale, filtered


class BlockDrafter(Drafter):
    """DFlash / DSpark drafting for a batch, using the target's embedding and LM head."""

    def __init__(self, model: DSparkModel, target: CausalLM, name: str = "dspark", max_drafts: int | None = None,
                 bias_candidates: int | None = None, markov_table: bool | None = None) -> None:
        """`bias_candidates` K: a vanilla Markov head adds its bias only to each slot's K largest base logits
        and drafts from those K tokens (q is zero elsewhere), so a high-rank head reads K rows of W2 per
        slot instead of all V; None adds it to the whole vocabulary.

        `markov_table`: keep the vanilla Markov bias of each previous token, a row of W1·W2ᵀ [V, V] in
        float32, computed the first time that token precedes a slot (and the whole table at once when
        1/32 of it has been); later slots after it read the row instead of a rank-r product over all of
        W2. None does so when the whole table takes at most MARKOV_TABLE_MAX_BYTES (V up to 8192)."""
        if max_drafts is not None and not 1 <= max_drafts <= model.cfg.num_drafts:
            raise ValueError(f"gamma must be in [1, {model.cfg.num_drafts}] for this drafter, got {max_drafts}")
        if bias_candidates is not None and not 1 <= bias_candidates <= model.cfg.vocab_size:
            raise ValueError(f"bias_candidates must be in [1, {model.cfg.vocab_size}], got {bias_candidates}")
        self.max_drafts = max_drafts
        self.bias_candidates = bias_candidates
        vocab = model.cfg.vocab_size
        self.markov_table = vocab * vocab * 4 <= MARKOV_TABLE_MAX_BYTES if markov_table is None else markov_table
        self.model = model.eval()
        self.cfg = model.cfg
        self.name = name
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.get_output_embeddings()
        self.feature_layers = tuple(self.cfg.target_layer_ids)
        self.ctx = ContextCache()
        #: rounds observed but not yet projected into `ctx`: (features [R, w, F], counts [R]) in round order
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    #: queued rounds at which `observe` projects the queue without waiting for a draft: rows joining and leaving
    #: re-index every queued round, so an unbounded queue (a long back-off at 64 requests) made each such step
    #: cost more than the rounds it saved (19% of a step at 64 requests, temperature 1)
    PENDING_LIMIT = 8

    @property
    def gamma(self) -> int:
        """Draft tokens proposed per round."""
        return self.cfg.num_drafts

    def _append_context(self, features: torch.Tensor, counts: torch.Tensor, into: ContextCache | None = None) -> None:
        ctx = self.ctx if into is None else into
        if ctx.kv:
            start = ctx.offsets + ctx.lengths
        else:  # a fresh cache: its rows start at 0, or where rows joining late are (`join_late`)
            start = ctx.offsets if ctx.offsets.shape == counts.shape else torch.zeros_like(counts)
        positions = start.view(-1, 1) + torch.arange(features.shape[1], device=features.device).view(1, -1)
        with torch.no_grad():
            kv = self.model.context_kv(features, positions)
        ctx.append(kv, counts)

    def reset(self) -> None:
        """Drop every row's context."""
        self.ctx = ContextCache()
        self._pending = []

    def join(self, prompts, prefill_features) -> None:
        """Add rows whose context cache holds the prefill features (every prompt token but the last)."""
        if not prompts:
            return
        counts = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=prefill_features.device)
        fresh = ContextCache()
        self._append_context(prefill_features, counts, fresh)
        self.ctx.extend(fresh)
        self._pad_pending(len(prompts))

    def join_late(self, sequences) -> bool:
        """Add rows for requests that are already decoding but whose target features were never captured (they
        ran or were admitted while the drafter slept): each row's context starts empty at its anchor's position
        and holds what `observe` queues from then on, so its first block reads the anchor alone and later ones
        the text since. The target features of recent tokens summarise the text before them, so drafts recover
        within a few rounds; they are verified like any others."""
        if not sequences:
            return True
        device = self.embed.weight.device
        dim = self.model.fc.in_features
        fresh = ContextCache()
        fresh.offsets = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long, device=device)
        counts = torch.zeros(len(sequences), dtype=torch.long, device=device)
        self._append_context(torch.zeros(len(sequences), 1, dim, device=device), counts, fresh)  # one masked slot
        self.ctx.extend(fresh)
        self._pad_pending(len(sequences))
        return True

    def _pad_pending(self, joined: int) -> None:
        """Give every queued round `joined` new rows at the end, with nothing queued."""
        self._pending = [(torch.cat([f, f.new_zeros(joined, *f.shape[1:])]), torch.cat([c, c.new_zeros(joined)]))
                         for f, c in self._pending]

    def observe(self, outcome: RoundOutcome) -> None:
        """Queue the features of each row's anchor and accepted drafts for the context. They are projected at
        the next `propose`, all rounds since the last one in one pass: a round that drafts nothing (a back-off,
        a plain probe) costs the drafter no pass of its own, and a run of them one pass per PENDING_LIMIT rounds."""
        counts = [a + 1 for a in outcome.accepted]
        features = outcome.features[:, : max(counts)]  # slots no row keeps are not queued
        self._pending.append((features, torch.tensor(counts, dtype=torch.long, device=features.device)))
        if len(self._pending) >= self.PENDING_LIMIT:
            self._flush()

    def _flush(self) -> None:
        """Project the queued rounds into the context: each row's queued tokens packed in order, one pass."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            self._append_context(*pending[0])
            return
        totals = torch.stack([c for _, c in pending]).sum(0)
        first = pending[0][0]
        packed = first.new_zeros(first.shape[0], max(1, int(totals.max())), first.shape[2])
        offset = torch.zeros_like(totals)
        for features, counts in pending:
            rows, slots = (torch.arange(features.shape[1], device=counts.device).view(1, -1)
                           < counts.view(-1, 1)).nonzero(as_tuple=True)
            packed[rows, offset[rows] + slots] = features[rows, slots]
            offset += counts
        self._append_context(packed, totals)

    def select(self, rows: Sequence[int]) -> None:
        """Drop finished rows from the context cache (and from what is queued for it)."""
        self.ctx.select(rows)
        if self._pending:
            idx = torch.as_tensor(list(rows), dtype=torch.long, device=self._pending[0][1].device)
            self._pending = [(f[idx], c[idx]) for f, c in self._pending]

    def propose_rows(self, rows, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """`propose` over a copy of the given rows' context (`propose` changes no state beyond projecting the
        queued rounds into the context, which `propose_rows` does first for every row)."""
        self._flush()
        full = self.ctx
        self.ctx = full.subset(rows)
        try:
            return self.propose(sequences, sampling, generators)
        finally:
            self.ctx = full

    @torch.no_grad()
    def block_hidden(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final-normed hidden states [R, γ_block, d] of the block after each sequence's last token."""
        self._flush()
        device = self.ctx.valid.device
        num_rows, width = len(sequences), self.cfg.block_size
        pad = [self.cfg.mask_token_id] * (width - 1)
        ids = torch.tensor([[s[-1]] + pad for s in sequences], dtype=torch.long, device=device)
        start = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long, device=device)
        if not torch.equal(start, self.ctx.offsets + self.ctx.lengths):
            raise RuntimeError(f"draft context reaches {(self.ctx.offsets + self.ctx.lengths).tolist()} tokens, "
                               f"expected {start.tolist()}")
        positions = start.view(-1, 1) + torch.arange(width, device=device).view(1, -1)
        mask = None  # every context slot is real: attend to all
        if not self.ctx.dense:
            mask = torch.cat([self.ctx.valid, torch.ones(num_rows, width, dtype=torch.bool, device=device)], 1)
            mask = mask.unsqueeze(1)
        # the block's keys and values go into scratch slots after each layer's context: no copy of the context
        return self.model(self.embed(ids), positions, self.ctx.rooms(width), mask, room=True)

    @torch.no_grad()
    def propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """Sample γ drafts left to right from the block logits plus the sequential bias.

        Sampling draws one uniform per row and slot (one random call per row and block) and inverts each
        slot's cumulative distribution (`sample_inverse_cdf`); the slot's softmax is its q.
        """
        h = self.block_hidden(sequences)
        if self.cfg.slot_convention == "self":
            h = h[:, 1:]
        h = h[:, : min(self.max_drafts or h.shape[1], self.draft_limit or h.shape[1])]
        num_rows, gamma = h.shape[0], h.shape[1]
        device = h.device
        # U_k slot-major, [γ, R, V]: each slot's logits are contiguous for the sequential loop
        base = self.lm_head(h.transpose(0, 1)).float()
        head, conf_head = self.model.markov_head, self.model.confidence_head
        all_greedy = bool(sampling.greedy.all())
        uniforms = None if all_greedy else row_uniforms(gamma, sampling, generators, device)
        anchors = torch.tensor([s[-1] for s in sequences], dtype=torch.long, device=device)
        peaks = probs = None
        if head is None:  # plain DFlash: every slot is independent, sample the block at once
            if all_greedy:
                scaled, tokens = base.transpose(0, 1), argmax_last(base).t().contiguous()
            else:
                scaled = sampling_logits(base.transpose(0, 1), sampling)
                probs = probs_from_sampling_logits(scaled, sampling)  # greedy rows: one-hot, drawn for any u
                tokens = sample_inverse_cdf(probs, uniforms)
        else:
            scaled, tokens, peaks, probs = self._sample_sequential(h, base, anchors, sampling, uniforms)
        if probs is None and not all_greedy:
            probs = probs_from_sampling_logits(scaled, sampling)
        if peaks is None and self.report_peaks:  # greedy rows' sampling logits are their raw logits (T = 1)
            peaks = greedy_peaks(scaled, sampling.greedy)
        conf = None
        if conf_head is not None:  # c_k reads x_{k-1}, all known now: one batched call for the block
            prev_all = torch.cat([anchors.view(-1, 1), tokens[:, :-1]], 1)
            conf = torch.sigmoid(conf_head(h, self.model.prev_embed(prev_all)).float())
        lengths = torch.full((num_rows,), gamma, dtype=torch.long, device=device)
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, confidences=conf, peaks=peaks)

    def _sample_sequential(self, h, base, prev, sampling: BatchSampling, uniforms):
        """Left-to-right sampling with the sequential head over slot-major base logits [γ, R, V] (overwritten),
        by the uniforms [R, γ] (`row_uniforms`; None when every row is greedy).

        Returns the sampling logits [R, γ, V] (a view of `base`), the tokens [R, γ], the greedy rows' peaks
        (None here: `greedy_peaks` of the sampling logits gives them) and q [R, γ, V] (None when every row is
        greedy or the caller is to compute it from the sampling logits).
        """
        head = self.model.markov_head
        gamma, num_rows = base.shape[0], base.shape[1]
        fused = self._vanilla_markov
        if fused and self.bias_candidates is not None:
            return (*self._sample_candidates(base, prev, sampling, uniforms, self.bias_candidates), None)
        use_table = fused and self.markov_table
        full_table = self._markov_rows_for(None) if use_table else None  # None until every row is computed
        if fused and not use_table:  # vanilla Markov: bias = W1[x] · W2ᵀ, added to U_k in place by one addmm per slot
            w1, w2t = self._markov_weights()
        state = head.init_state(num_rows, h.device, h.dtype)
        plain = uniforms is None  # all greedy: argmax of U_k + bias
        if not plain:
            temp, scale, filtered = _loop_sampling(sampling)
            greedy = sampling.greedy.to(base.device) if bool(sampling.greedy.any()) else None
        tokens, probs = [], []
        for k in range(gamma):
            logits = base[k]
            if use_table:  # the same bias, one cached row per previous token
                logits.add_(full_table[prev] if full_table is not None else self._markov_rows_for(prev))
            elif fused:
                logits.addmm_(w1[prev], w2t)
            else:
                bias, state = head.step(h[:, k], prev, state)
                logits.add_(bias.float())
            if plain:
                prev = argmax_last(logits)
            else:
                if scale:
                    logits.div_(temp)
                if filtered:
                    logits.copy_(filter_logits(logits.unsqueeze(1), sampling.top_k, sampling.top_p).squeeze(1))
                q = torch.softmax(logits, dim=-1)
                prev = sample_inverse_cdf(q, uniforms[:, k])
                if greedy is not None:  # greedy rows of a mixed batch take their argmax
                    prev = torch.where(greedy, argmax_last(logits), prev)
                probs.append(q)
            tokens.append(prev)
        scaled = base.transpose(0, 1)
        q = None if plain else greedy_onehot(torch.stack(probs, 1), scaled, sampling)
        return scaled, torch.stack(tokens, 1), None, q

    def _sample_candidates(self, base, prev, sampling: BatchSampling, uniforms, k_cand: int):
        """Left-to-right sampling over each slot's top-K base candidates with the vanilla Markov bias.

        Per slot: bias_c = W2[c] · W1[x_{k−1}] for the K candidates c only; greedy takes the best candidate,
        sampling applies temperature and top-k/top-p among the candidates and inverts their cumulative
        distribution at the row's uniform. The returned sampling logits are -inf outside the candidates, so q is exactly
        the distribution drafted from (greedy-only blocks leave `base` unbiased, so their rows' peaks are taken
        over the candidates here). Same return values as `_sample_sequential`.
        """
        w1, w2t = self._markov_weights()
        w2 = self._markov_rows(w2t)
        vals, idx = base.topk(k_cand, dim=-1)  # [γ, R, K]
        idx, order = idx.sort(-1)  # in token order, a uniform picks the token the whole vocabulary's would
        vals = vals.gather(-1, order)
        plain = uniforms is None
        if not plain:
            temp, scale, filtered = _loop_sampling(sampling)
            greedy = sampling.greedy.to(base.device) if bool(sampling.greedy.any()) else None
        tokens, peaks = [], []
        for k in range(base.shape[0]):
            cand = vals[k] + torch.bmm(w2[idx[k]], w1[prev].unsqueeze(-1)).squeeze(-1)  # [R, K]
            if plain:
                if self.report_peaks:
                    peaks.append(torch.exp(cand.amax(-1) - torch.logsumexp(cand, -1)))
                pick = argmax_last(cand)
            else:
                if scale:
                    cand = cand / temp
                if filtered:
                    cand = filter_logits(cand.unsqueeze(1), sampling.top_k, sampling.top_p).squeeze(1)
                pick = sample_inverse_cdf(torch.softmax(cand, dim=-1), uniforms[:, k])
                if greedy is not None:  # greedy rows of a mixed batch take their best candidate
                    pick = torch.where(greedy, argmax_last(cand), pick)
                base[k].fill_(float("-inf")).scatter_(-1, idx[k], cand)
            prev = idx[k].gather(-1, pick.unsqueeze(-1)).squeeze(-1)
            tokens.append(prev)
        return base.transpose(0, 1), torch.stack(tokens, 1), torch.stack(peaks, 1) if peaks else None

    def _markov_rows(self, w2t: torch.Tensor) -> torch.Tensor:
        """W2 [V, r] (one row per token) from the cached W2ᵀ, for gathering candidate rows."""
        if getattr(self, "_markov_rows_src", None) is not w2t:
            self._markov_rows_cache = w2t.t().contiguous()
            self._markov_rows_src = w2t
        return self._markov_rows_cache

    def prepare(self) -> None:
        """Compute the whole Markov bias table now (when it is kept; see `markov_table`): filled lazily, it
        is computed at once when 1/MARKOV_TABLE_FILL_FRACTION of its rows are, inside some drafting call
        (0.4–1.1 s on a 2-core CPU for V = 8192), which stalls that step for every request in the batch."""
        if self.markov_table and self._vanilla_markov and self.bias_candidates is None:
            self._markov_rows_for(None, fill=True)

    @property
    def _vanilla_markov(self) -> bool:
        """Whether the sequential head is the plain low-rank Markov bias W1[x]·W2ᵀ (no gate, no RNN)."""
        head = self.model.markov_head
        return type(head) is MarkovHead and head.gate_proj is None

    def _markov_rows_for(self, prev: torch.Tensor | None, fill: bool = False) -> torch.Tensor | None:
        """The Markov bias rows W1[x]·W2ᵀ [R, V] of the tokens `prev`, from the row cache (filled on a miss).

        With prev None: the whole table once every row is computed, else None. fill: compute every row first."""
        w1, w2t = self._markov_weights()
        if getattr(self, "_markov_table_src", None) is not w2t:
            vocab = w2t.shape[1]  # the rows are written when first needed; untouched pages cost no memory
            self._markov_table_cache = torch.empty(vocab, vocab, dtype=torch.float32, device=w2t.device)
            self._markov_table_filled = torch.zeros(vocab, dtype=torch.bool, device=w2t.device)
            self._markov_table_src = w2t
            self._markov_table_full = False
        table, filled = self._markov_table_cache, self._markov_table_filled
        if prev is not None and not self._markov_table_full and not bool(filled[prev].all()):
            missing = prev[~filled[prev]].unique()
            table[missing] = w1[missing] @ w2t
            filled[missing] = True
            # past 1/32 of the rows, filling the rest in one product costs less than row by row
            fill = fill or int(filled.sum()) * MARKOV_TABLE_FILL_FRACTION >= filled.numel()
        if fill and not self._markov_table_full:
            rest = (~filled).nonzero().squeeze(1)
            table[rest] = w1[rest] @ w2t
            filled[rest] = True
            self._markov_table_full = True
        if prev is None:
            return table if self._markov_table_full else None
        return table[prev]

    def _markov_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 W1 [V, r] and W2ᵀ [r, V] of the vanilla Markov head, converted once per weight version."""
        head = self.model.markov_head
        key = tuple((p.data_ptr(), p._version) for p in (head.markov_w1.weight, head.markov_w2.weight))
        if getattr(self, "_markov_key", None) != key:
            self._markov_cache = (head.markov_w1.weight.float(), head.markov_w2.weight.float().t().contiguous())
            self._markov_key = key
        return self._markov_cache
