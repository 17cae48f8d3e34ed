"""Lossless verification of draft tokens for a batch of requests with per-request draft lengths.

Greedy rows accept drafts while they equal the target argmax. Sampled rows use speculative rejection
sampling (Leviathan et al. 2023): with p the target distribution and q the draft distribution that x was
drawn from, accept x with probability min(1, p(x)/q(x)); at the first rejection sample the corrected
token from norm(max(0, p - q)); when every draft passes, sample the bonus token from p. The committed
sequence is then distributed exactly as the target's own samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.sampling import BatchSampling, logits_to_probs


@dataclass
class VerifyResult:
    """Outcome of one verification round.

    accepted[r]: number of draft tokens of request r that were accepted.
    tokens[r]: the tokens to commit: the accepted drafts, then the corrected or bonus token (absent when
    an accepted draft was an end-of-sequence token, which ends the request).
    """

    accepted: list[int]
    tokens: list[list[int]]


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: BatchSampling,
    generators: list[torch.Generator],
    eos_token_ids: frozenset[int] = frozenset(),
) -> VerifyResult:
    """Verify drafts against the target and return what each request commits.

    target_logits: [R, Lmax+1, V]; position j holds the target's logits for the token after the anchor
        and the first j drafts.
    draft_tokens: [R, Lmax] (entries past draft_lens[r] are ignored); draft_lens: [R], 0 allowed.
    draft_probs: [R, Lmax, V] distributions the drafts were sampled from (after the request's own
        temperature/top-k/top-p), or None for drafters without probabilities (treated as one-hot q).
    """
    num_rows, width, _ = target_logits.shape
    device = target_logits.device
    max_len = width - 1
    if draft_tokens.shape[1] < max_len:
        raise ValueError(f"draft_tokens has {draft_tokens.shape[1]} columns, target_logits implies {max_len}")
    draft_tokens = draft_tokens[:, :max_len].to(device)
    draft_lens = draft_lens.to(device)
    in_draft = torch.arange(max_len, device=device).view(1, -1) < draft_lens.view(-1, 1)

    greedy = sampling.greedy
    accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
    next_token = torch.zeros(num_rows, dtype=torch.long, device=device)

    if bool(greedy.any()):
        argmax = target_logits.argmax(-1)
        match = (draft_tokens == argmax[:, :max_len]) & in_draft
        g_acc = torch.cumprod(match.long(), dim=1).sum(1)
        accepted = torch.where(greedy, g_acc, accepted)
        next_token = torch.where(greedy, argmax.gather(1, g_acc.view(-1, 1)).squeeze(1), next_token)

    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        sub = BatchSampling(sampling.temperature[rows], sampling.top_k[rows], sampling.top_p[rows])
        p = logits_to_probs(target_logits[rows], sub)  # [S, Lmax+1, V]
        drafts = draft_tokens[rows]
        p_x = p[:, :max_len].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # p(x_j)
        if draft_probs is None:
            q = None
            q_x = torch.ones_like(p_x)
        else:
            q = draft_probs[rows].to(device=device, dtype=torch.float32)
            q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # q(x_j)
        for i, r in enumerate(sampled_rows):
            n = int(draft_lens[r])
            gen = generators[r]
            u = torch.rand(n, generator=gen, device=device)
            # accept x_j iff u_j < p(x_j)/q(x_j), written without division
            ok = (u * q_x[i, :n] < p_x[i, :n]).long()
            a = int(torch.cumprod(ok, 0).sum()) if n else 0
            if a < n:
                if q is None:
                    residual = p[i, a].clone()
                    residual[drafts[i, a]] = 0.0
                else:
                    residual = (p[i, a] - q[i, a]).clamp_min(0.0)
                total = residual.sum()
                # total == 0 only when p == q, where rejection has probability 0; guard rounding.
                dist = residual / total if total > 0 else p[i, a]
            else:
                dist = p[i, n]
            accepted[r] = a
            next_token[r] = torch.multinomial(dist, 1, generator=gen).squeeze()

    acc_list = accepted.tolist()
    nxt_list = next_token.tolist()
    drafts_list = draft_tokens.tolist()
    tokens: list[list[int]] = []
    for r in range(num_rows):
        committed = drafts_list[r][: acc_list[r]]
        eos_at = next((j for j, t in enumerate(committed) if t in eos_token_ids), None)
        if eos_at is not None:
            committed = committed[: eos_at + 1]
            acc_list[r] = eos_at + 1
        else:
            committed = committed + [nxt_list[r]]
        tokens.append(committed)
    return VerifyResult(accepted=acc_list, tokens=tokens)
