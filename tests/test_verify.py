"""Losslessness of verification, proven statistically.

Each test draws N independent rounds (rows of one batched `verify` call, each with its own seeded
generator) and compares the committed tokens' frequencies with the target distribution by a chi-square
test. Each test uses a false-alarm rate ALPHA = 1e-4 (the seeds are fixed, so the run is reproducible).
A deliberately wrong verifier that skips the residual distribution must fail the same test.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.api import encode_prompt
from dspark.sampling import BatchSampling, SamplingParams, logits_to_probs
from dspark.verify import verify

ALPHA = 1e-4
N = 20000


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Target sampling distribution written out independently of dspark.sampling.

    As in HF transformers and vLLM: keep the top-k logits, renormalise, then keep the smallest prefix
    (by descending probability) whose mass reaches top_p.
    """
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    probs = np.exp(z[order] - z[order].max())
    probs /= probs.sum()
    keep = np.zeros_like(z, dtype=bool)
    mass = 0.0
    for rank, idx in enumerate(order):
        if rank > 0 and mass >= top_p:
            break
        keep[idx] = True
        mass += probs[rank]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test; bins with expected count < 5 are pooled."""
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def run_rounds(target_logits, draft_probs, params: SamplingParams, n=N, seed=0, use_q=True, verifier=verify):
    """Run n independent verification rounds; return the committed token lists."""
    gamma = draft_probs.shape[0]
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(draft_probs[j], n, replacement=True, generator=gen) for j in range(gamma)], 1)
    logits = target_logits.unsqueeze(0).expand(n, -1, -1)
    probs = draft_probs.unsqueeze(0).expand(n, -1, -1) if use_q else None
    sampling = BatchSampling.from_params([params] * n, "cpu")
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]
    res = verifier(logits, drafts, torch.full((n,), gamma), probs, sampling, gens)
    return res.tokens


def wrong_verify(target_logits, drafts, lens, draft_probs, sampling, gens, eos=frozenset()):
    """A broken verifier: on rejection it samples from p instead of norm(max(0, p - q))."""
    p = logits_to_probs(target_logits, sampling)
    out = []
    for r in range(drafts.shape[0]):
        toks = []
        for j in range(int(lens[r])):
            x = int(drafts[r, j])
            q = float(draft_probs[r, j, x]) if draft_probs is not None else 1.0
            if float(torch.rand(1, generator=gens[r])) * q < float(p[r, j, x]):
                toks.append(x)
                continue
            toks.append(int(torch.multinomial(p[r, j], 1, generator=gens[r])))
            break
        else:
            toks.append(int(torch.multinomial(p[r, int(lens[r])], 1, generator=gens[r])))
        out.append(toks)
    return type("R", (), {"tokens": out})()


def toy_problem(vocab=6, gamma=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(gamma + 1, vocab, generator=g) * 1.5
    draft_probs = torch.softmax(torch.randn(gamma, vocab, generator=g) * 1.5, -1)
    return target_logits, draft_probs


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["T1", "T0.7-topk4-topp0.9"],
)
def test_toy_first_and_second_tokens_follow_target(params):
    target_logits, q = toy_problem()
    # the drafter samples from its own filtered distribution; verification must still give p
    tokens = run_rounds(target_logits, q, params)
    p = [reference_probs(target_logits[j].numpy(), params.temperature, params.top_k, params.top_p) for j in range(4)]
    first = np.array([t[0] for t in tokens])
    second = np.array([t[1] for t in tokens if len(t) >= 2])
    assert len(second) > 2000
    assert chi2_pvalue(first, p[0]) > ALPHA
    assert chi2_pvalue(second, p[1]) > ALPHA


def test_one_hot_drafts_follow_target():
    """Drafters without probabilities (n-gram) are treated as one-hot q."""
    target_logits, q = toy_problem(seed=3)
    tokens = run_rounds(target_logits, q, SamplingParams(temperature=1.0), use_q=False)
    p0 = reference_probs(target_logits[0].numpy(), 1.0, 0, 1.0)
    assert chi2_pvalue(np.array([t[0] for t in tokens]), p0) > ALPHA


def test_wrong_verifier_is_caught():
    target_logits, q = toy_problem()
    tokens = run_rounds(target_logits, q, SamplingParams(temperature=1.0), n=8000, verifier=wrong_verify)
    p0 = reference_probs(target_logits[0].numpy(), 1.0, 0, 1.0)
    assert chi2_pvalue(np.array([t[0] for t in tokens]), p0) < ALPHA


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["T1", "T0.7-topk20-topp0.9"])
def test_bundled_target_next_token_distribution(bundled_target, bundled_draft, params):
    # a prompt where draft and target distributions overlap but differ (TV about 0.5), so a wrong
    # verifier is visible; with disjoint supports every draft is rejected and the residual equals p
    ids = encode_prompt(bundled_target, "What is a tuple?")
    with torch.no_grad():
        t_logits = bundled_target.model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        d_logits = bundled_draft.model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
    sampling = BatchSampling.from_params([params], "cpu")
    q = logits_to_probs(d_logits.unsqueeze(0), sampling)[0]  # [1, V]
    target_logits = torch.cat([t_logits, t_logits])  # position 1 (bonus) is unused by the first-token test
    tokens = run_rounds(target_logits, q, params, seed=5)
    p0 = reference_probs(t_logits[0].numpy(), params.temperature, params.top_k, params.top_p)
    assert chi2_pvalue(np.array([t[0] for t in tokens]), p0) > ALPHA
    wrong = run_rounds(target_logits, q, params, n=8000, seed=6, verifier=wrong_verify)
    assert chi2_pvalue(np.array([t[0] for t in wrong]), p0) < ALPHA


def test_greedy_accepts_matching_prefix_and_stops_at_eos():
    logits = torch.full((3, 4, 10), -5.0)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    logits.scatter_(-1, argmax.unsqueeze(-1), 5.0)
    drafts = torch.tensor([[1, 2, 9], [1, 2, 3], [7, 0, 0]])
    lens = torch.tensor([3, 3, 0])
    sampling = BatchSampling.from_params([SamplingParams()] * 3, "cpu")
    gens = [torch.Generator() for _ in range(3)]
    res = verify(logits, drafts, lens, None, sampling, gens)
    assert res.accepted == [2, 3, 0]
    assert res.tokens == [[1, 2, 3], [1, 2, 3, 4], [5]]
    res = verify(logits, drafts, lens, None, sampling, gens, eos_token_ids=frozenset({2}))
    assert res.accepted == [2, 2, 0]
    assert res.tokens == [[1, 2], [1, 2], [5]]  # an accepted EOS ends the round without a bonus token


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    target_logits, q = toy_problem()
    logits = target_logits.unsqueeze(0).expand(2, -1, -1)
    drafts = torch.stack([torch.tensor([0, 1, 2]), target_logits[:3].argmax(-1)])
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, seed=1), SamplingParams()], "cpu")
    res = verify(logits, drafts, torch.tensor([3, 3]), q.unsqueeze(0).expand(2, -1, -1), sampling,
                 [torch.Generator().manual_seed(1), torch.Generator()])
    assert res.accepted[1] == 3
    assert res.tokens[1] == target_logits.argmax(-1).tolist()
    # the sampled row: the same result as verified alone, and a well-formed commit
    alone = verify(target_logits.unsqueeze(0), drafts[:1], torch.tensor([3]), q.unsqueeze(0),
                   BatchSampling.from_params([SamplingParams(temperature=1.0, seed=1)], "cpu"),
                   [torch.Generator().manual_seed(1)])
    assert (res.accepted[0], res.tokens[0]) == (alone.accepted[0], alone.tokens[0])
    assert res.tokens[0][: res.accepted[0]] == [0, 1, 2][: res.accepted[0]] and len(res.tokens[0]) == res.accepted[0] + 1


def test_sampled_row_beside_a_greedy_row_follows_the_target():
    """Drafts drawn from q for the sampled row, a greedy row beside it: the sampled row's first committed
    token is distributed as the target's p (4.5-sigma bands over 4000 trials)."""
    target_logits, q = toy_problem()
    logits = target_logits.unsqueeze(0).expand(2, -1, -1)
    greedy_drafts = target_logits[:3].argmax(-1)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0), SamplingParams()], "cpu")
    draw = torch.Generator().manual_seed(5)
    counts = torch.zeros(q.shape[-1])
    trials = 4000
    for t in range(trials):
        drafts = torch.stack([torch.multinomial(q, 1, generator=draw).squeeze(-1), greedy_drafts])
        res = verify(logits, drafts, torch.tensor([3, 2]), q.unsqueeze(0).expand(2, -1, -1), sampling,
                     [torch.Generator().manual_seed(t), torch.Generator()])
        counts[res.tokens[0][0]] += 1
        assert res.tokens[1][:2] == greedy_drafts[:2].tolist()
    p = torch.softmax(target_logits[0], -1)
    sigma = (p * (1 - p) / trials).sqrt()
    assert ((counts / trials - p).abs() <= 4.5 * sigma + 1e-9).all(), (counts / trials, p)
