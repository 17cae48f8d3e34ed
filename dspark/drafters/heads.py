"""DSpark's sequential correction heads and the confidence head.

A block drafter's logits U_k for all γ slots come from one parallel pass, so slot k cannot see which
token was sampled at slot k−1 ("suffix decay"). The heads add a cheap bias that depends on the
previously sampled token x_{k−1}, and are sampled left to right:

    MarkovHead (vanilla):  bias_k = W2 · W1[x_{k−1}]                       (rank-r transition)
    MarkovHead (gated):    bias_k = W2 · (σ(G[h_k; W1[x_{k−1}]]) ⊙ W1[x_{k−1}])
    RNNHead (paper eq. 6): [g, c, o] = J[s_{k−1}; W1[x_{k−1}]; h_k]
                           s_k = σ(g) ⊙ s_{k−1} + (1 − σ(g)) ⊙ tanh(c),  bias_k = W2 · tanh(o)
    ConfidenceHead:        c_k = σ(w · [h_k; W1[x_{k−1}]] + b)  (predicted survival of draft k)
"""
from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Low-rank transition bias from the previous token; `gated` modulates it by the slot's hidden state."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, gated: bool = False) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank, bias=True) if gated else None
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain DFlash drafter

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The Markov head keeps no state."""
        return None

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """bias [R, V] for one slot with hidden h [R, d] and previous tokens prev [R]."""
        e = self.markov_w1(prev)
        if self.gate_proj is not None:
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e.to(h.dtype)], -1))) * e
        return self.markov_w2(e), state

    def block_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """bias [..., γ, V] for all slots at once given the previous tokens (teacher forcing).

        Without a gate the bias depends on the previous token only, so it is computed once per distinct
        token and gathered (training blocks overlap: far fewer distinct tokens than slots)."""
        if self.gate_proj is not None:
            return self.step(h, prev, None)[0]
        uniq, inv = torch.unique(prev, return_inverse=True)
        return self.markov_w2(self.markov_w1(uniq))[inv]


class RNNHead(nn.Module):
    """Gated recurrent bias whose state carries every earlier draft of the block (paper eq. 6)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=True)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)

    def init_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """s_0 = 0."""
        return torch.zeros(batch, self.rank, device=device, dtype=dtype)

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor):
        """(bias [R, V], s_k) for one slot from h [R, d], prev [R] and s_{k−1} [R, r]."""
        e = self.markov_w1(prev).to(h.dtype)
        g, c, o = self.joint_proj(torch.cat([state.to(h.dtype), e, h], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        state = gate * state + (1 - gate) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), state

    def block_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """bias [R, γ, V], unrolled over the slots with teacher-forced previous tokens."""
        state = self.init_state(h.shape[0], h.device, h.dtype)
        out = []
        for k in range(h.shape[1]):
            bias, state = self.step(h[:, k], prev[:, k], state)
            out.append(bias)
        return torch.stack(out, 1)


class ConfidenceHead(nn.Module):
    """Logit of the probability that a draft survives verification, from [h_k; W1[x_{k−1}]] (or h_k)."""

    def __init__(self, hidden_size: int, rank: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=True)

    def forward(self, h: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """Confidence logits [...] (apply a sigmoid, after calibration, for c_k)."""
        x = h if prev_embed is None else torch.cat([h, prev_embed.to(h.dtype)], -1)
        return self.proj(x).squeeze(-1)


def build_sequential_head(kind: str, vocab_size: int, hidden_size: int, rank: int) -> nn.Module | None:
    """Return the head named by a checkpoint's `markov_head_type` (None when rank is 0)."""
    if rank <= 0:
        return None
    if kind == "vanilla":
        return MarkovHead(vocab_size, hidden_size, rank)
    if kind == "gated":
        return MarkovHead(vocab_size, hidden_size, rank, gated=True)
    if kind == "rnn":
        return RNNHead(vocab_size, hidden_size, rank)
    raise ValueError(f"unknown markov_head_type {kind!r}")
