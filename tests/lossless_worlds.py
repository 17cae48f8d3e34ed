"""Toy worlds for the losslessness suite (tests/test_lossless.py): targets with known distributions, drafters
with known q, a scheduler host that runs many independent small steps inside one `decode` call, and the
statistical tests.

Everything here is deterministic given its seeds; the statistical thresholds live in test_lossless.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.stats import chi2 as chi2_dist
from scipy.stats import chi2_contingency, norm
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import BatchSampling, SamplingParams, logits_to_probs, row_uniforms, sample_inverse_cdf
from dspark.scheduling import CostModel, Scheduler, StepPlan
from dspark.target import CausalLM

# ------------------------------------------------------------------------------------------------------
# targets


def markov_target(transitions: torch.Tensor) -> CausalLM:
    """A real Qwen3 whose next-token distribution is exactly transitions[current token] (any context).

    transitions: [V, V], row x = P(next | last token x). The decoder layer's output projections are zero,
    so the residual stream is the token embedding e_x (a one-hot); the final RMSNorm scales it by
    1/sqrt(1/d + eps) and the LM head's column x holds log P(· | x) divided by that factor, so the logits
    are log P(· | x) up to float32 rounding. It runs through `CausalLM` (KV cache, masks, rollback) like
    any HF model.
    """
    vocab = transitions.shape[0]
    hidden = 4 * math.ceil(max(vocab, 8) / 4)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    cfg.eos_token_id = None
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.norm.weight.fill_(1.0)
        factor = 1.0 / math.sqrt(1.0 / hidden + cfg.rms_norm_eps)
        head = torch.zeros(vocab, hidden)
        head[:, :vocab] = transitions.double().clamp_min(1e-30).log().t().float() / factor
        model.lm_head.weight.copy_(head)
    return CausalLM(model)


def scaled_random_qwen3(vocab: int, layers: int, hidden: int, seed: int, head_std: float) -> Qwen3ForCausalLM:
    """A random-weight Qwen3 whose LM head is re-drawn with std `head_std` (so next-token distributions
    are neither uniform nor one-hot)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=128, tie_word_embeddings=False)
    cfg.eos_token_id = None
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_std, generator=torch.Generator().manual_seed(seed + 1000))
    return model


def primed(transitions: torch.Tensor) -> torch.Tensor:
    """A Markov table [3V, 3V] whose first generated token is known, so the first drafting round is controlled.

    A request's first token comes from the prefill (no drafts); the first round drafts from it. Tokens
    0..V−1 follow `transitions`; prompt token V + j (`prompt_token(j, V)`) is followed for sure by start
    token 2V + j, which continues like token j and is never an end-of-sequence token. So prompt [V + j]
    behaves, from its second generated token on, as the first tokens after token j."""
    vocab = transitions.shape[0]
    out = torch.zeros(3 * vocab, 3 * vocab, dtype=transitions.dtype)
    out[:vocab, :vocab] = transitions
    out[2 * vocab :, :vocab] = transitions
    out[vocab + torch.arange(vocab), 2 * vocab + torch.arange(vocab)] = 1.0
    return out


def primed_table(table: torch.Tensor) -> torch.Tensor:
    """A drafter table [V, V] widened to the primed vocabulary: start token 2V + j drafts like token j
    (prompt tokens never anchor a round; they get row 0)."""
    vocab = table.shape[0]
    out = torch.zeros(3 * vocab, 3 * vocab, dtype=table.dtype)
    out[:vocab, :vocab] = table
    out[vocab : 2 * vocab, :vocab] = table[0]
    out[2 * vocab :, :vocab] = table
    return out


def primed_vector(values: torch.Tensor) -> torch.Tensor:
    """A per-token vector [V] (a confidence read off the previous token) widened likewise."""
    values = torch.as_tensor(values)
    return torch.cat([values, values.new_full(values.shape, float(values[0])), values])


def prompt_token(j: int, vocab: int) -> int:
    """The prompt token of a primed world whose first generated token behaves as token j."""
    return vocab + j


def start_token(j: int, vocab: int) -> int:
    """The first generated token after prompt_token(j) (certain)."""
    return 2 * vocab + j


@torch.no_grad()
def next_probs(target: CausalLM, context: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution [V] (float64) after `context`, by a direct forward of the HF model."""
    logits = target.model(input_ids=torch.tensor([list(context)])).logits[:, -1:].float()
    return logits_to_probs(logits, BatchSampling.from_params([params], "cpu"))[0, 0].double()


def exact_pair(target: CausalLM, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Exact joint distribution [V, V] of the next two tokens after `prompt`, enumerating the first one."""
    p1 = next_probs(target, prompt, params)
    joint = torch.zeros(len(p1), len(p1), dtype=torch.float64)
    for x in torch.nonzero(p1 > 0).flatten().tolist():
        joint[x] = p1[x] * next_probs(target, list(prompt) + [x], params)
    return joint.numpy()


def exact_triple(target: CausalLM, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Exact joint distribution [V, V, V] of the first three generated tokens (the prefill's token and the
    two of the first drafting round), enumerating the first two."""
    p1 = next_probs(target, prompt, params).numpy()
    joint = np.zeros((len(p1),) * 3)
    for x in np.flatnonzero(p1 > 0).tolist():
        joint[x] = p1[x] * exact_pair(target, list(prompt) + [x], params)
    return joint


END = -1  # stands for "no further token" (an earlier one ended the request)


def exact_prefixes_sparse(target: CausalLM, prompt: Sequence[int], params: SamplingParams, depth: int,
                          eos: frozenset[int] = frozenset()) -> dict[tuple[int, ...], float]:
    """Exact P(first `depth` generated tokens) as {(x1, .., x_depth): p} over the support (large vocabularies);
    a sequence that reaches an end-of-sequence token early is padded with END."""
    out: dict[tuple[int, ...], float] = {}

    def walk(context: list[int], prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == depth:
            out[prefix] = mass
            return
        probs = next_probs(target, context, params)
        for x in torch.nonzero(probs > 0).flatten().tolist():
            if x in eos:
                out[prefix + (x,) + (END,) * (depth - len(prefix) - 1)] = mass * float(probs[x])
            else:
                walk(context + [x], prefix + (x,), mass * float(probs[x]))

    walk(list(prompt), (), 1.0)
    return out


def sparse_cells(token_lists: Sequence[Sequence[int]], exact: dict[tuple[int, ...], float]) -> tuple[np.ndarray, np.ndarray]:
    """(counts, probs) over exact's support plus one cell of probability 0 for sequences outside it."""
    keys = list(exact)
    depth = len(keys[0])
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    for t in token_lists:
        key = tuple(t[:depth]) + (END,) * (depth - len(t[:depth]))
        counts[index.get(key, len(keys))] += 1
    return counts, np.append(np.array([exact[k] for k in keys]), 0.0)


# ------------------------------------------------------------------------------------------------------
# drafters with known q


class TableDrafter(Drafter):
    """A drafter with explicit tables: q_k(· | x_{k−1}) = tables[k−1][x_{k−1}] (x_0 = the anchor).

    confidences: None (no head), a list of γ vectors [V] (c_k = conf[k−1][x_{k−1}]: it reads only the token
    before, as DSpark's head does), or "own-q" (c_k = q_k(x_k), the drafted token's own probability: the
    anticipating estimator that must be caught). `calibration` is read by the decoding loop when set. It drafts
    only the first `draft_limit` slots when the decoding loop sets one, as the block drafters do.
    """

    name = "table"

    def __init__(self, tables: Sequence[torch.Tensor], confidences=None, calibration=None) -> None:
        self.tables = [torch.as_tensor(t, dtype=torch.float32) for t in tables]
        self.gamma = len(self.tables)
        self.confidences = confidences
        self.calibration = calibration

    def propose(self, sequences, sampling: BatchSampling, generators) -> DraftBlock:
        prev = torch.tensor([s[-1] for s in sequences], dtype=torch.long)
        width = min(self.gamma, self.draft_limit or self.gamma)
        u = row_uniforms(width, sampling, generators, prev.device)
        greedy = sampling.greedy
        tokens, probs, conf = [], [], []
        for k, table in enumerate(self.tables[:width]):
            q = table[prev]
            x = torch.where(greedy, q.argmax(-1), sample_inverse_cdf(q, u[:, k]))
            if self.confidences == "own-q":
                conf.append(q.gather(1, x.view(-1, 1)).squeeze(1))
            elif self.confidences is not None:
                conf.append(torch.as_tensor(self.confidences[k], dtype=torch.float32)[prev])
            tokens.append(x)
            probs.append(q)
            prev = x
        num = len(sequences)
        return DraftBlock(tokens=torch.stack(tokens, 1), lengths=torch.full((num,), width, dtype=torch.long),
                          probs=torch.stack(probs, 1), confidences=torch.stack(conf, 1) if conf else None)


class Recorder(Drafter):
    """Wraps a drafter and keeps the first block it proposed (to read q of the first round)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.first: DraftBlock | None = None

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    @property
    def feature_layers(self):  # class attribute on Drafter: forward explicitly
        return self.inner.feature_layers

    def reset(self):
        self.first = None
        self.inner.reset()

    def join(self, prompts, prefill_features):
        self.inner.join(prompts, prefill_features)

    def propose(self, sequences, sampling, generators):
        block = self.inner.propose(sequences, sampling, generators)
        if self.first is None:
            self.first = block
        return block

    def observe(self, outcome):
        self.inner.observe(outcome)

    def select(self, rows):
        self.inner.select(rows)


# ------------------------------------------------------------------------------------------------------
# schedulers


class GlobalSearch(Scheduler):
    """Anticipating on purpose (paper, Appendix A): the global argmax of Θ over the CURRENT block's survivals
    (no early stop), then that many drafts in admission order. Must be caught by the distribution tests."""

    def __init__(self, gamma: int) -> None:
        super().__init__("dspark", gamma)

    def plan(self, survival, limits, cost=None, token_budget=None, request_ids=None) -> StepPlan:
        from dspark.scheduling import best_capacity, top_capacity

        a = np.asarray(survival, dtype=np.float64)
        capacity, theta = best_capacity(a, limits, cost, token_budget)
        return StepPlan(top_capacity(a, limits, capacity, cost, token_budget).tolist(), theta, capacity)


class CurrentWidth(Scheduler):
    """Anticipating on purpose: dspark with the drafted width chosen from the CURRENT block's survivals
    (`best_width` over the block being planned, then Algorithm 1 on that many slots) instead of from the last
    finished step's. The width's choice reads a[k + 1], which reads x_k, and so decides on draft k after
    seeing it. Must be caught by the distribution tests."""

    def __init__(self, gamma: int) -> None:
        super().__init__("dspark", gamma)

    def plan(self, survival, limits, cost=None, token_budget=None, request_ids=None) -> StepPlan:
        from dspark.scheduling import best_width, prefix_schedule

        a = np.asarray(survival, dtype=np.float64)
        width = best_width(a, limits, cost, token_budget)
        lengths, theta = prefix_schedule(a[:, :width], np.minimum(limits, width), cost, token_budget)
        return StepPlan(lengths.tolist(), theta, int(lengths.sum()))


ANTICIPATING = {"global-search": GlobalSearch, "current-width": CurrentWidth}


def make_policy(spec: str, gamma: int) -> Scheduler:
    return ANTICIPATING[spec](gamma) if spec in ANTICIPATING else Scheduler(spec, gamma)


class HostedSteps(Scheduler):
    """Runs many independent small steps inside one `decode` call.

    Requests are grouped by request id (group g = id // group_size, the rows of a batch of `group_size`
    concurrent requests); group g is scheduled by its own policy specs[g % len(specs)], a real `Scheduler`
    (or `GlobalSearch`) that sees only its group's survivals, limits and ids, with the cost model for that
    group's batch size. A group whose policy backs off (wants_drafts False) verifies nothing that step.

    history(ids) -> list of earlier survival arrays [len(ids), γ]: plans the policy runs on creation, as if
    earlier steps of those requests had happened (so `dspark-async` reads stale survivals from the start).
    memo=True (group_size 1 only): policies are pure functions of (spec, history, survival row, limit), so
    each distinct input is planned once by a fresh policy and reused (10^5 rows stay affordable).
    """

    def __init__(self, specs: Sequence[str], gamma: int, group_size: int,
                 history: Callable[[list[int]], list[np.ndarray]] | None = None, memo: bool = False) -> None:
        super().__init__("dspark", gamma)  # decode then computes survivals and calls plan every drafted step
        if memo and group_size != 1:
            raise ValueError("memo needs group_size 1")
        self.specs = list(specs)
        self.group_size = group_size
        self.history = history
        self.memo = memo
        self.inner: dict[int, Scheduler] = {}
        self.cache: dict[tuple, int] = {}
        self.plans = 0

    def policy_of(self, request_id: int) -> str:
        return self.specs[(request_id // self.group_size) % len(self.specs)]

    def wants_drafts(self, num_rows: int) -> bool:
        return True

    def _fresh(self, group: int, ids: list[int], limits, cost, token_budget) -> Scheduler:
        policy = make_policy(self.specs[group % len(self.specs)], self.gamma)
        for old in (self.history(ids) if self.history is not None else []):
            policy.plan(old if policy.needs_survival else None, limits, cost, token_budget, ids)
        return policy

    def plan(self, survival, limits, cost=None, token_budget=None, request_ids=None) -> StepPlan:
        a = np.asarray(survival.cpu() if isinstance(survival, torch.Tensor) else survival, dtype=np.float64)
        lim = np.asarray(limits, dtype=np.int64)
        ids = np.asarray(request_ids, dtype=np.int64)
        lengths = np.zeros(len(ids), dtype=np.int64)
        if self.memo:
            for r, i in enumerate(ids.tolist()):
                hist = self.history([i]) if self.history is not None else []
                key = (self.policy_of(i), a[r].tobytes(), int(lim[r]), b"".join(h.tobytes() for h in hist))
                if key not in self.cache:
                    policy = self._fresh(i, [i], lim[r : r + 1], cost, token_budget)
                    self.plans += 1
                    ok = policy.wants_drafts(1)
                    self.cache[key] = policy.plan(a[r : r + 1], lim[r : r + 1], cost, token_budget, [i]).lengths[0] if ok else 0
                lengths[r] = self.cache[key]
            return StepPlan(lengths.tolist())
        groups = ids // self.group_size
        order = np.argsort(groups, kind="stable")
        bounds = np.flatnonzero(np.diff(groups[order])) + 1
        for rows in np.split(order, bounds):
            g = int(groups[rows[0]])
            gid = ids[rows].tolist()
            policy = self.inner.get(g)
            if policy is None:
                policy = self.inner[g] = self._fresh(g, gid, lim[rows], cost, token_budget)
            if not policy.wants_drafts(len(rows)):
                continue
            self.plans += 1
            plan = policy.plan(a[rows] if policy.needs_survival else None, lim[rows], cost, token_budget, gid)
            lengths[rows] = plan.lengths
        return StepPlan(lengths.tolist())


def jagged_cost_model(max_batch: int, gamma: int, layout: str, rng: np.random.Generator) -> CostModel:
    """A random step-cost table with plateaus and cliffs (a CUDA-graph-like staircase) for batches 1..max_batch.

    Drafting costs 0–5% of a step, each query token 1–8% of a step and a cliff (one token in five) 10–30%
    more, so the best schedule depends on the survivals: sometimes all drafts, sometimes a cut, sometimes
    none."""
    drafted, plain = {}, {}
    for b in range(1, max_batch + 1):
        base = 1.0 + 0.05 * b
        plain[b] = base * rng.uniform(0.95, 1.05)
        secs, cells = base * rng.uniform(1.0, 1.05), []
        for n in range(b, b * (gamma + 1) + 1):
            if n > b:
                secs += base * (rng.uniform(0.01, 0.08) + (rng.uniform(0.1, 0.3) if rng.random() < 0.2 else 0.0))
            cells.append((n, secs))
        drafted[b] = cells
    return CostModel(drafted, plain, layout)


def linear_cost_model(max_batch: int, gamma: int, per_draft: float) -> CostModel:
    """Ragged steps: a plain step costs 1, drafting 0.05 more, each verified draft `per_draft` more, so a
    draft pays when its survival exceeds about Θ·per_draft."""
    drafted = {b: [(n, 1.05 + per_draft * (n - b)) for n in range(b, b * (gamma + 1) + 1)] for b in range(1, max_batch + 1)}
    return CostModel(drafted, {b: 1.0 for b in range(1, max_batch + 1)}, "ragged")


# ------------------------------------------------------------------------------------------------------
# statistics


def gof_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square statistic and degrees of freedom of counts against probs (same shape, flattened).

    Cells with expected count < 5 are pooled into one cell. An observation in a cell of probability 0 is
    an outright failure (returns inf).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return math.inf, 1
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-12:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the chi-square goodness-of-fit test (see gof_statistic)."""
    stat, dof = gof_statistic(counts, probs)
    if math.isinf(stat):
        return 0.0
    return 1.0 if dof == 0 else float(chi2_dist.sf(stat, dof))


def combined_pvalue(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """One chi-square test over independent samples: the statistics and their degrees of freedom add up."""
    stats = [gof_statistic(c, p) for c, p in parts]
    if any(math.isinf(s) for s, _ in stats):
        return 0.0
    dof = sum(d for _, d in stats)
    return 1.0 if dof == 0 else float(chi2_dist.sf(sum(s for s, _ in stats), dof))


def pair_counts(token_lists: Sequence[Sequence[int]], vocab: int, skip: int = 0) -> np.ndarray:
    """[V, V] counts of tokens skip and skip + 1 of each list (skip 1: the first drafting round's two
    tokens, after the prefill's)."""
    out = np.zeros((vocab, vocab))
    for t in token_lists:
        out[t[skip], t[skip + 1]] += 1
    return out


def triple_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """[V, V, V] counts of the first three tokens of each list."""
    out = np.zeros((vocab, vocab, vocab))
    for t in token_lists:
        out[t[0], t[1], t[2]] += 1
    return out


def binomial_z(successes: int, trials: int, p: float) -> float:
    """z-score of a binomial count against its exact success probability p."""
    if trials == 0:
        return 0.0
    sd = math.sqrt(trials * p * (1 - p))
    if sd == 0:
        return 0.0 if successes == trials * p else math.inf
    return (successes - trials * p) / sd


def bernoulli_sum_z(successes: int, probs: Sequence[float]) -> float:
    """z-score of a count of independent Bernoulli trials with success probabilities `probs` (each row's
    exact acceptance probability, which differs between rows of different contexts)."""
    probs = np.asarray(probs, dtype=np.float64)
    if len(probs) == 0:
        return 0.0
    sd = math.sqrt(float((probs * (1 - probs)).sum()))
    mean = float(probs.sum())
    if sd == 0:
        return 0.0 if successes == mean else math.inf
    return (successes - mean) / sd


def two_sided_z(alpha: float) -> float:
    """|z| beyond which a two-sided normal test rejects at false-alarm rate alpha."""
    return float(norm.isf(alpha / 2))


def nth_token(tokens: Sequence[int], n: int) -> int:
    """The n-th generated token (0-based), or END when an earlier one ended the request."""
    return tokens[n] if len(tokens) > n else END


def two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and dof of the 2×K contingency table of two samples of tokens (tokens seen
    fewer than 10 times in both samples together are pooled into one column)."""
    tokens = np.union1d(a, b)
    table = np.array([[np.sum(a == t) for t in tokens], [np.sum(b == t) for t in tokens]], dtype=float)
    small = table.sum(0) < 10
    table = np.concatenate([table[:, ~small], table[:, small].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 0.0, 0
    stat, _, dof, _ = chi2_contingency(table, correction=False)
    return float(stat), int(dof)
