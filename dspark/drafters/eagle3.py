"""EAGLE-3-style baseline: one autoregressive draft layer over [token embedding; projected target features].

At position t the layer reads the pair (h_t, x_{t+1}), where h_t = fc(target features at t) for committed
text and the draft's own output hidden state while drafting, and predicts x_{t+2}. Its input is
[input_layernorm(embed(x_{t+1})); hidden_norm(h_t)] (2d wide); attention is causal over the draft's own
KV cache. Drafting chains k steps, feeding each output hidden state back with the sampled token.
Parameter names follow DeepSpec's `Qwen3Eagle3Model` (`fc`, `layers.0.*`, `norm`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dspark.attention import gqa_attention
from dspark.drafters.base import DraftBlock, Drafter, RoundOutcome
from dspark.drafters.dflash_model import DraftMLP, RMSNorm, RopeTable, project_qkv
from dspark.kv_cache import HeadroomLayer
from dspark.sampling import BatchSampling, argmax_last, greedy_peaks, logits_to_probs
from dspark.target import CausalLM


@dataclass
class Eagle3Config:
    """Shape of the EAGLE-3 draft layer; ttt_length = drafting / training horizon."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    def to_dict(self) -> dict:
        """Plain-dict form."""
        return asdict(self)


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2d-wide [token; hidden] input."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * d, h * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.__dict__["rope"] = RopeTable(hd, cfg.rope_theta)  # plain attribute: not in the state dict

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated queries [R, H, q, hd], keys and values [R, KV, q, hd] of inputs x [R, q, 2d]."""
        c = self.cfg
        cos, signed_sin = self.rope.rolled(positions, x.dtype)
        return project_qkv(self, x, cos, signed_sin, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Output [R, q, d] of queries over keys/values with bool mask [R, q, T]."""
        out = gqa_attention(q, k, v, mask.unsqueeze(1))
        r, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(r, n, -1))


class Eagle3Layer(nn.Module):
    """The single EAGLE-3 decoder layer; the residual stream is the hidden input h."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def inputs(self, tok_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embedding); hidden_norm(h)]."""
        return torch.cat([self.input_layernorm(tok_embeds), self.hidden_norm(hidden)], -1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual add, then the MLP block."""
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(nn.Module):
    """fc over target features, one draft layer, final norm; the target's embedding and LM head are shared."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """h = fc(target features)."""
        return self.fc(features.to(self.fc.weight.dtype))


class Eagle3Drafter(Drafter):
    """Chains γ autoregressive draft steps per round, batched, with a ragged per-row KV cache.

    Pending pairs (target feature at t, token at t+1) of newly committed text are fed at the start of
    each proposal; the speculative steps' cache entries are dropped after the round.
    """

    name = "eagle3"

    def __init__(self, model: Eagle3Model, target: CausalLM, gamma: int | None = None) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.gamma = gamma or self.cfg.ttt_length
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.get_output_embeddings()
        self.feature_layers = tuple(self.cfg.target_layer_ids)
        self._reset(0, torch.device("cpu"))

    def _reset(self, rows: int, device: torch.device) -> None:
        self.cache = HeadroomLayer()  # the draft layer's K/V, appended in place (dspark.kv_cache)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        # per row, the queued pairs' features in chunks (a round's each), concatenated at the next draft: a growing
        # tensor copied on every round cost a long back-off at 64 requests 9% of a step
        self.pending_feats: list[list[torch.Tensor]] = []
        self.pending_toks: list[list[int]] = []

    def reset(self) -> None:
        """Drop every row."""
        self._reset(0, next(self.model.parameters()).device)

    def join(self, prompts, prefill_features) -> None:
        """Add rows with an empty cache and the prompt's (feature_t, x_{t+1}) pairs queued."""
        if not prompts:
            return
        count, device = len(prompts), self.valid.device
        if self.cache.is_initialized:  # the new rows' slots are all invalid (zeros, masked)
            self.cache.extend_rows(None, None, count, self.valid.shape[1])
        self.valid = torch.cat([self.valid, torch.zeros(count, self.valid.shape[1], dtype=torch.bool, device=device)])
        self.lengths = torch.cat([self.lengths, torch.zeros(count, dtype=torch.long, device=device)])
        self.pending_feats += [[prefill_features[r, : len(p) - 1]] for r, p in enumerate(prompts)]
        self.pending_toks += [list(p[1:]) for p in prompts]

    def observe(self, outcome: RoundOutcome) -> None:
        """Queue (feature, next committed token) for the anchor and every accepted draft."""
        for r, (acc, toks) in enumerate(zip(outcome.accepted, outcome.committed)):
            n = len(toks)  # acc drafts + bonus (or acc drafts ending in EOS)
            # rounds that skipped drafting leave earlier pairs pending: queue behind them
            self.pending_feats[r].append(outcome.features[r, :n])
            self.pending_toks[r] = self.pending_toks[r] + list(toks)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the given rows."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        if self.cache.is_initialized:
            self.cache.select_rows(idx)
        self.valid, self.lengths = self.valid[idx], self.lengths[idx]
        self.pending_feats = [self.pending_feats[r] for r in rows]
        self.pending_toks = [self.pending_toks[r] for r in rows]

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Feed [R, q] pairs (first counts[r] real), append them to the cache, return output hidden [R, q, d]."""
        layer = self.model.layers[0]
        r, q = tokens.shape
        positions = self.lengths.view(-1, 1) + torch.arange(q, device=tokens.device).view(1, -1)
        x = layer.inputs(self.embed(tokens).to(hidden.dtype), hidden)
        qs, ks, vs = layer.self_attn.qkv(x, positions)
        new_valid = torch.arange(q, device=tokens.device).view(1, -1) < counts.view(-1, 1)
        keys, values = self.cache.update(ks, vs)
        old = self.valid.shape[1]
        causal = torch.ones(q, q, dtype=torch.bool, device=tokens.device).tril()
        mask = torch.cat([self.valid.unsqueeze(1).expand(-1, q, -1), causal.unsqueeze(0) & new_valid.unsqueeze(1)], 2)
        mask[:, :, old:] |= torch.eye(q, dtype=torch.bool, device=tokens.device)  # padding rows see themselves
        self.valid = torch.cat([self.valid, new_valid], 1)
        self.lengths = self.lengths + counts
        return layer.finish(hidden, layer.self_attn.attend(qs, keys, values, mask))

    def _truncate(self, lengths: torch.Tensor) -> None:
        rank = torch.cumsum(self.valid.long(), 1)
        self.valid &= rank <= lengths.view(-1, 1)
        self.lengths = lengths.clone()
        width = int(self.valid.any(0).nonzero().max()) + 1 if bool(self.valid.any()) else 0
        self.cache.keys, self.cache.values = self.cache.keys[:, :, :width], self.cache.values[:, :, :width]
        self.valid = self.valid[:, :width]

    def _state(self) -> tuple:
        """The per-row state, to restore after a failed or trial proposal. `propose` writes the cache only
        past the views kept here (appends into spare slots, or a re-homed copy), so the views stay valid."""
        return (self.cache, self.cache.keys, self.cache.values, self.valid, self.lengths,
                [list(f) for f in self.pending_feats],
                list(self.pending_toks))

    def _restore(self, state: tuple) -> None:
        self.cache, keys, values, self.valid, self.lengths, self.pending_feats, self.pending_toks = state
        self.cache.keys, self.cache.values = keys, values

    def propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """Feed the pending pairs, then chain γ draft steps (if it raises, the state is as it was)."""
        state = self._state()
        try:
            return self._propose(sequences, sampling, generators)
        except BaseException:
            self._restore(state)
            raise

    def propose_rows(self, rows, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        """`propose` for the given rows; the state is then restored (their pairs stay pending)."""
        state = self._state()
        try:
            if self.cache.is_initialized:  # selects into a copy: in place it would move the batch's own rows
                self.cache = HeadroomLayer.holding(self.cache.keys, self.cache.values)
            self.select(rows)
            return self._propose(sequences, sampling, generators)
        finally:
            self._restore(state)

    @torch.no_grad()
    def _propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        num_rows = len(sequences)
        device = self.valid.device
        counts = torch.tensor([len(t) for t in self.pending_toks], dtype=torch.long, device=device)
        width = max(1, int(counts.max()))
        feats = torch.zeros(num_rows, width, self.model.fc.in_features, device=device)
        toks = torch.zeros(num_rows, width, dtype=torch.long, device=device)
        for r in range(num_rows):
            if counts[r]:
                feats[r, : counts[r]] = torch.cat(self.pending_feats[r])
            toks[r, : counts[r]] = torch.tensor(self.pending_toks[r], dtype=torch.long)
        out = self._step(self.model.project(feats), toks, counts)
        committed = self.lengths.clone()
        # A one-token prompt has no pair yet; its first drafts are then guesses (verification keeps them lossless).
        hidden = out[torch.arange(num_rows, device=device), (counts - 1).clamp_min(0)].unsqueeze(1)  # [R, 1, d]
        gamma = min(self.gamma, self.draft_limit or self.gamma)  # each slot is a forward pass: draft no more
        tokens = torch.zeros(num_rows, gamma, dtype=torch.long, device=device)
        probs = None
        greedy = sampling.greedy.tolist()
        all_greedy = all(greedy)
        ones = torch.ones(num_rows, dtype=torch.long, device=device)
        peaks = []
        for k in range(gamma):
            logits = self.lm_head(self.model.norm(hidden)).float()[:, 0]  # [R, V]
            if self.report_peaks:
                peaks.append(greedy_peaks(logits.unsqueeze(1), sampling.greedy))
            if all_greedy:  # one-hot q: verification needs only the tokens
                tokens[:, k] = argmax_last(logits)
            else:
                q = logits_to_probs(logits.unsqueeze(1), sampling)[:, 0]
                if probs is None:
                    probs = torch.zeros(num_rows, gamma, q.shape[-1], device=device)
                probs[:, k] = q
                for r in range(num_rows):
                    tokens[r, k] = q[r].argmax() if greedy[r] else torch.multinomial(q[r], 1, generator=generators[r])[0]
            if k + 1 < gamma:
                hidden = self._step(hidden, tokens[:, k : k + 1], ones)
        self._truncate(committed)
        self.pending_feats = [[] for _ in self.pending_feats]
        self.pending_toks = [[] for _ in self.pending_toks]
        lengths = torch.full((num_rows,), gamma, dtype=torch.long, device=device)
        peak = torch.cat(peaks, 1) if peaks and peaks[0] is not None else None
        return DraftBlock(tokens=tokens, lengths=lengths, probs=probs, peaks=peak)
