"""Tests written to kill surviving mutants of the engine's commit / rollback path (benchmarks/mutation_test.sh).

A tiny Markov target whose greedy continuation of token x is x + 1 (mod 8) and a scripted drafter whose first
`good(sequence)` drafts are right make every round exact: which drafts are accepted, what is committed, what
the target cache keeps (every token but the anchor), what the drafter, the cost model and the online
calibrator are told, the StepInfo, stop tokens and stop strings, rows leaving the batch, and a drafting fault.
"""
from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch

from dspark.calibration.signals import block_signals
from dspark.drafters.base import DraftBlock, Drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.request import Request
from dspark.sampling import SamplingParams
from dspark.scheduling import CostModel, Scheduler, step_tokens, uniform_cost_model
from tests.lossless_worlds import markov_target

V = 8


def chain(last: int, n: int) -> list[int]:
    """The target's greedy continuation of a sequence ending in `last`."""
    return [(last + 1 + i) % V for i in range(n)]


def chain_target(tokenizer=None):
    trans = torch.full((V, V), 0.05)
    for x in range(V):
        trans[x, (x + 1) % V] = 0.65
    target = markov_target(trans)
    target.tokenizer = tokenizer
    return target


class LetterTokenizer:
    """Token i is the letter "abcdefgh"[i]."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[i] for i in ids)


class ScriptedDrafter(Drafter):
    """Drafts `gamma` tokens: the first good(sequence) follow the target's greedy chain, the rest are wrong.

    with_probs: report q (q_draft on the drafted token, the rest spread evenly); conf: per-position confidences; fail(sequence): drafting
    raises for such a row (in `propose` and, row by row, in `propose_rows`)."""

    name = "scripted"

    def __init__(self, gamma=3, good=lambda seq: 3, with_probs=False, conf=None, fail=None, calibration=None,
                 feature_layers=(), q_draft=0.9):
        self.gamma, self.good, self.with_probs, self.conf, self.fail = gamma, good, with_probs, conf, fail
        self.q_draft = q_draft
        self.calibration = calibration
        self.feature_layers = tuple(feature_layers)
        self.blocks: list[DraftBlock] = []
        self.outcomes = []
        self.selects: list[list[int]] = []
        self.calls = 0

    def _block(self, seqs) -> DraftBlock:
        rows = []
        for s in seqs:
            k = self.good(s)
            rows.append([t if j < k else (t + 3) % V for j, t in enumerate(chain(s[-1], self.gamma))])
        tokens = torch.tensor(rows, dtype=torch.long).view(len(seqs), self.gamma)
        probs = None
        if self.with_probs:
            probs = torch.full((len(seqs), self.gamma, V), (1 - self.q_draft) / (V - 1))
            probs.scatter_(-1, tokens.unsqueeze(-1), self.q_draft)
        conf = torch.tensor([self.conf] * len(seqs), dtype=torch.float32) if self.conf is not None else None
        return DraftBlock(tokens, torch.full((len(seqs),), self.gamma), probs, conf)

    def _check(self, seqs):
        if self.fail is not None and any(self.fail(s) for s in seqs):
            raise RuntimeError("poisoned row")

    def propose(self, sequences, sampling, generators):
        self.calls += 1
        self._check(sequences)
        block = self._block(sequences)
        self.blocks.append(block)
        return block

    def propose_rows(self, rows, sequences, sampling, generators):
        self._check(sequences)
        return self._block(sequences)

    def observe(self, outcome):
        self.outcomes.append(outcome)

    def select(self, rows):
        self.selects.append(list(rows))


def make_engine(drafter, scheduler="fixed", cost=None, tokenizer=None, online=None, eos=frozenset(), **config):
    infos = []
    engine = Engine(chain_target(tokenizer), drafter, scheduler, cost,
                    EngineConfig(detokenize=tokenizer is not None, **config), online_calibration=online,
                    eos_token_ids=eos, on_step=infos.append)
    return engine, infos


def run(engine, requests):
    """Step until done; return the outputs of every step, checking after each that the target cache of every
    running row holds its prompt and output but the anchor (the last committed token)."""
    for req in requests:
        engine.add(req)
    steps = []
    while engine.has_work:
        steps.append(engine.step())
        for row, req in enumerate(engine.running):
            assert int(engine.target.lengths[row]) == len(req.prompt_ids) + len(req.output_ids) - 1
    return steps


def streamed(steps, req):
    return [t for outs in steps for o in outs if o.request is req for t in o.token_ids]


# ------------------------------------------------------------------------------------------------------
# commit and rollback


def test_greedy_rounds_commit_the_accepted_prefix_and_roll_back_the_rest():
    good = lambda seq: len(seq) % 4  # 0..3 right drafts, changing from round to round  # noqa: E731
    drafter = ScriptedDrafter(gamma=3, good=good)
    engine, infos = make_engine(drafter)
    reqs = [Request([0, 1, 2], max_tokens=11), Request([5], max_tokens=7)]
    steps = run(engine, reqs)
    for req in reqs:
        assert req.output_ids == chain(req.prompt_ids[-1], req.max_tokens)
        assert req.finish_reason == "length" and req.state == "finished"
        assert streamed(steps, req) == req.output_ids
        assert [o.finished for outs in steps for o in outs if o.request is req][-1] is True
        assert req.arrival_time <= req.first_token_time <= req.finish_time
        first = req.rounds[0]  # the prefill's pseudo-round: no drafts, the first token
        assert (first.draft_len, first.available, first.accepted, first.signals) == (0, 0, 0, None)
        seq = list(req.prompt_ids) + chain(req.prompt_ids[-1], 1)
        for rs in req.rounds[1:]:  # drafts verified: the block, within the tokens left after the bonus token
            n = min(3, req.max_tokens - (len(seq) - len(req.prompt_ids)) - 1)
            assert (rs.draft_len, rs.available, rs.accepted) == (n, n, min(good(seq), n))
            seq += chain(seq[-1], rs.accepted + 1)
        assert seq == req.prompt_ids + req.output_ids
    # the drafter is told each round's commits: the accepted drafts, then the target's own token
    assert len(drafter.outcomes) == len(infos) == len(drafter.blocks)
    for info, outcome, block in zip(infos, drafter.outcomes, drafter.blocks):
        assert outcome.accepted == info.accepted and outcome.features is None
        for r, committed in enumerate(outcome.committed):
            a = outcome.accepted[r]
            assert len(committed) == a + 1
            assert committed[:a] == block.tokens[r, :a].tolist()
            assert committed[a] == (committed[a - 1] + 1) % V if a else True


def test_sampled_rows_commit_accepted_drafts_and_one_more_token():
    drafter = ScriptedDrafter(gamma=3, good=lambda seq: 2, with_probs=True)
    engine, infos = make_engine(drafter)
    reqs = [Request([1], SamplingParams(temperature=0.9, seed=s), max_tokens=9) for s in range(4)]
    run(engine, reqs)
    for req in reqs:
        assert len(req.output_ids) == 9
        seq = list(req.prompt_ids)
        for rs in req.rounds:
            assert 0 <= rs.accepted <= rs.draft_len
            seq += req.output_ids[len(seq) - 1 : len(seq) - 1 + rs.accepted + 1]
        assert seq == req.prompt_ids + req.output_ids
    again = [Request([1], SamplingParams(temperature=0.9, seed=s), max_tokens=9) for s in range(4)]
    run(make_engine(ScriptedDrafter(gamma=3, good=lambda seq: 2, with_probs=True))[0], again)
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]  # seeded: reproducible


def test_sampled_drafts_whose_q_is_below_p_are_always_accepted():
    """The drafts follow the chain, where p = 0.65 at temperature 1, and report q = 0.5 there: u·q < p for every
    u < 1, so every draft is accepted (treating the drafts as one-hot q would reject each with probability 0.35)."""
    drafter = ScriptedDrafter(gamma=3, with_probs=True, q_draft=0.5)
    engine, _ = make_engine(drafter)
    reqs = [Request([s % V], SamplingParams(temperature=1.0, seed=s), max_tokens=9) for s in range(12)]
    run(engine, reqs)
    for req in reqs:
        assert [(r.draft_len, r.accepted) for r in req.rounds] == [(0, 0), (3, 3), (3, 3)]  # prefill, 2 rounds
        out = req.output_ids  # the prefill's token, then accepted drafts and the sampled bonus token, each round
        assert out[1:4] == chain(out[0], 3) and out[5:8] == chain(out[4], 3) and len(out) == 9


def test_target_features_reach_the_drafter():
    drafter = ScriptedDrafter(gamma=2, feature_layers=(-1,))  # the embedding output
    engine, infos = make_engine(drafter)
    run(engine, [Request([0, 1], max_tokens=5), Request([3, 4, 5], max_tokens=3)])
    hidden = engine.target.model.config.hidden_size
    for info, outcome in zip(infos, drafter.outcomes):
        assert outcome.features is not None
        assert tuple(outcome.features.shape) == (info.batch, max(info.lengths) + 1, hidden)


# ------------------------------------------------------------------------------------------------------
# stop tokens


def test_a_stop_token_among_the_accepted_drafts_ends_the_round_there():
    # the prefill commits 1; round 1 anchors on it, drafts 2 3 4 (all right) and adds the bonus token 5
    engine, infos = make_engine(ScriptedDrafter(gamma=3), eos=frozenset({4}))
    cut = Request([0], max_tokens=10, stop_token_ids=frozenset({3}))  # draft 2 of round 1
    bonus = Request([0], max_tokens=10, stop_token_ids=frozenset({5}), ignore_eos=True)  # round 1's bonus token
    eos = Request([0], max_tokens=10)  # the target's EOS (4): draft 3 of round 1
    ignore = Request([0], max_tokens=7, ignore_eos=True)  # decodes past the EOS
    steps = run(engine, [cut, bonus, eos, ignore])
    assert (cut.output_ids, cut.finish_reason, cut.rounds[1].accepted) == ([1, 2, 3], "stop", 2)
    assert (bonus.output_ids, bonus.finish_reason, bonus.rounds[1].accepted) == ([1, 2, 3, 4, 5], "stop", 3)
    assert (eos.output_ids, eos.finish_reason, eos.rounds[1].accepted) == ([1, 2, 3, 4], "stop", 3)
    assert (ignore.output_ids, ignore.finish_reason) == (chain(0, 7), "length")
    assert [(r.draft_len, r.accepted) for r in ignore.rounds] == [(0, 0), (3, 3), (1, 1)]
    assert infos[0].accepted == [2, 3, 3, 3]
    assert drafter_committed(engine)[0] == [[2, 3], [2, 3, 4, 5], [2, 3, 4], [2, 3, 4, 5]]
    for req in (cut, bonus, eos, ignore):
        assert streamed(steps, req) == req.output_ids


def drafter_committed(engine):
    return [o.committed for o in engine.drafter.outcomes]


def test_stop_token_ids_and_eos_are_both_stops_unless_eos_is_ignored():
    engine, _ = make_engine(ScriptedDrafter(gamma=3, good=lambda seq: 1), eos=frozenset({6}))
    both = Request([0], max_tokens=10, stop_token_ids=frozenset({7}))  # EOS 6 comes first
    only_ids = Request([0], max_tokens=10, stop_token_ids=frozenset({7}), ignore_eos=True)
    neither = Request([3], max_tokens=6, ignore_eos=True)
    run(engine, [both, only_ids, neither])
    assert (both.output_ids, both.finish_reason) == (chain(0, 6), "stop")
    assert (only_ids.output_ids, only_ids.finish_reason) == (chain(0, 7), "stop")
    assert (neither.output_ids, neither.finish_reason) == (chain(3, 6), "length")


# ------------------------------------------------------------------------------------------------------
# stop strings and text


def test_without_a_tokenizer_there_is_no_text_and_the_first_token_time_stays():
    engine, _ = make_engine(ScriptedDrafter(gamma=1, good=lambda seq: 0))
    req = Request([0], max_tokens=3)
    engine.add(req)
    outs = [o for o in engine.step()]
    first = req.first_token_time
    assert first is not None and req.arrival_time <= first
    while engine.has_work:
        outs += engine.step()
    assert req.first_token_time == first <= req.finish_time  # the first commit's time, never moved later
    # one output per step: the prefill's token leaves with round 1's
    assert [o.text for o in outs] == ["", ""] and req.text == "" and req.output_ids == [1, 2, 3]


def test_the_first_token_time_is_when_it_leaves_the_engine_with_round_one():
    """The prefill's token is committed before the step's round but leaves the engine with it (one merged
    output), so TTFT is stamped at the round's commit, not at the prefill."""
    engine, _ = make_engine(ScriptedDrafter(gamma=2))
    req = Request([0], max_tokens=10)
    engine.add(req)
    round_started = []
    inner = engine._decode_round

    def timed(outputs, side=None):
        round_started.append(time.perf_counter())
        return inner(outputs, side)

    engine._decode_round = timed
    outs = engine.step()
    assert [(o.request is req, o.token_ids) for o in outs] == [(True, [1, 2, 3, 4])]
    assert req.first_token_time >= round_started[0]


def test_stop_string_completed_by_the_rounds_last_token_keeps_every_token():
    engine, _ = make_engine(ScriptedDrafter(gamma=2), tokenizer=LetterTokenizer())
    req = Request([0], max_tokens=10, stop=["e"])  # the prefill commits b, round 1 c d e: the stop is its last token
    steps = run(engine, [req])
    assert (req.output_ids, req.text, req.finish_reason) == ([1, 2, 3, 4], "bcd", "stop")
    assert streamed(steps, req) == [1, 2, 3, 4]


def test_text_held_back_for_a_stop_string_is_released_at_the_length_limit():
    engine, _ = make_engine(ScriptedDrafter(gamma=2), tokenizer=LetterTokenizer())
    req = Request([0], max_tokens=5, stop=["hh"])  # never matches; the last letter is held back until the end
    steps = run(engine, [req])
    deltas = [o.text for outs in steps for o in outs]
    assert deltas[-1].endswith("f") and "".join(deltas) == req.text == "bcdef" and req.finish_reason == "length"
    # one letter is held back while a stop string could follow: step 1 (the prefill's "b", round 1's "cde")
    # streams "bcd", step 2 the rest
    assert deltas == ["bcd", "ef"]


def test_stop_strings_cut_tokens_and_text_and_text_streams():
    engine, _ = make_engine(ScriptedDrafter(gamma=2), tokenizer=LetterTokenizer())
    stop = Request([0], max_tokens=10, stop=["ef"])  # text b | c d e | f g ...: "ef" completes at token 5, in round 2
    plain = Request([0], max_tokens=5)
    steps = run(engine, [stop, plain])
    assert (stop.output_ids, stop.text, stop.finish_reason) == ([1, 2, 3, 4, 5], "bcd", "stop")
    assert streamed(steps, stop) == [1, 2, 3, 4, 5]
    assert "".join(o.text for outs in steps for o in outs if o.request is stop) == "bcd"
    assert (plain.output_ids, plain.text, plain.finish_reason) == ([1, 2, 3, 4, 5], "bcdef", "length")
    assert "".join(o.text for outs in steps for o in outs if o.request is plain) == "bcdef"


def test_stop_string_completed_by_an_early_token_of_a_long_round():
    """The prefill commits b; round 1 commits c d e (three tokens); "d" completes the stop string at the
    round's token 2: one token is dropped."""
    engine, _ = make_engine(ScriptedDrafter(gamma=2), tokenizer=LetterTokenizer())
    req = Request([0], max_tokens=10, stop=["d"])
    steps = run(engine, [req])
    assert (req.output_ids, req.text, req.finish_reason) == ([1, 2, 3], "bc", "stop")
    assert [o.token_ids for outs in steps for o in outs] == [[1, 2, 3]]  # one output: the prefill's and round 1's
    assert [o.finished for outs in steps for o in outs] == [True]


def test_text_is_released_while_decoding():
    engine, _ = make_engine(ScriptedDrafter(gamma=1, good=lambda seq: 0), tokenizer=LetterTokenizer())
    req = Request([0], max_tokens=3)
    engine.add(req)
    texts = []
    while engine.has_work:
        for o in engine.step():
            texts.append((o.text, req.text, o.finished))
    # step 1 streams the prefill's "b" and round 1's "c" in one output; step 2 "d"
    assert texts == [("bc", "bc", False), ("d", "bcd", True)]


# ------------------------------------------------------------------------------------------------------
# rows leaving the batch


def test_finished_and_cancelled_rows_leave_target_and_drafter_alike():
    """Rows leave target and drafter with the same selection; the last rows fill the leavers' places."""
    drafter = ScriptedDrafter(gamma=1, good=lambda seq: 0)  # one token per round
    engine, _ = make_engine(drafter)
    # step k commits a request's first token (its prefill) and one more: k + 1 tokens after step k
    reqs = [Request([0], max_tokens=5, request_id="a"), Request([1], max_tokens=3, request_id="b"),
            Request([2], max_tokens=7, request_id="c"), Request([3], max_tokens=7, request_id="d")]
    for req in reqs:
        engine.add(req)
    outs = [engine.step() for _ in range(2)]  # b finishes in step 2
    assert [r.request_id for r in engine.running] == ["a", "d", "c"] and drafter.selects[-1] == [0, 3, 2]
    engine.cancel("c")
    outs.append(engine.step())  # c leaves first, then a round for a and d
    assert drafter.selects[-1] == [0, 1] and [r.request_id for r in engine.running] == ["a", "d"]
    assert reqs[2].finish_reason == "cancelled" and reqs[2].state == "finished"
    assert [(o.request.request_id, o.token_ids, o.finished) for o in outs[-1]] == [
        ("c", [], True), ("a", [4], False), ("d", [7], False)]
    while engine.has_work:
        outs.append(engine.step())
    assert drafter.selects[-2:] == [[1], []]  # a leaves after step 4, d after step 6
    assert [r.output_ids for r in reqs] == [chain(0, 5), chain(1, 3), chain(2, 3), chain(3, 7)]
    assert engine.reserved == 0


# ------------------------------------------------------------------------------------------------------
# what each round reports: StepInfo, the cost model, the online calibrator, recorded signals


def recording_cost(layout):
    cost = uniform_cost_model(gamma=3, batches=(1, 2, 4), per_token=0.01, layout=layout)
    cost.seen = []
    observe = cost.observe

    def record(batch, tokens, seconds, drafted, width=None, slots=None):
        cost.seen.append((batch, tokens, seconds, drafted, width))
        observe(batch, tokens, seconds, drafted, width, slots)

    cost.observe = record
    return cost


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_step_info_and_cost_model_observations(layout):
    cost = recording_cost(layout)
    drafter = ScriptedDrafter(gamma=3, good=lambda seq: 2, conf=[0.95, 0.9, 0.85])
    engine, infos = make_engine(drafter, "dspark", cost)
    reqs = [Request([0], max_tokens=8), Request([4], max_tokens=8, max_draft=1)]
    run(engine, reqs)
    assert len(infos) == len(cost.seen) > 0 and infos[0].planned
    for i, (info, seen) in enumerate(zip(infos, cost.seen)):
        rows = [r for r in reqs if len(r.rounds) > i + 1]  # rounds[0]: the prefill's token, no StepInfo
        assert info.batch == len(rows)
        assert info.lengths == [r.rounds[i + 1].draft_len for r in rows]
        assert info.accepted == [r.rounds[i + 1].accepted for r in rows]
        assert info.tokens == step_tokens(np.array(info.lengths), layout)
        if info.planned:  # Algorithm 1 planned the round
            assert info.drafted and info.capacity == sum(info.lengths) and info.expected_throughput > 0
        elif info.drafted:  # planning did not pay (the plans verified whole blocks): every available draft
            assert info.capacity is None and info.lengths == [r.rounds[i + 1].available for r in rows]
        else:
            assert info.capacity is None and info.expected_throughput is None and sum(info.lengths) == 0
        assert seen == (info.batch, info.tokens, info.seconds, info.drafted, info.draft_width)
        assert info.draft_width == (3 if info.drafted else None)  # the scripted drafter's block, priced as drafted
        assert info.planned == (info.capacity is not None)
        # the round's parts add up within it, and the round lies within its step
        assert min(info.draft_seconds, info.schedule_seconds, info.target_seconds, info.prefill_seconds) >= 0
        parts = info.draft_seconds + info.schedule_seconds + info.target_seconds
        assert parts <= info.seconds + 1e-9 and info.seconds <= info.step_seconds
        assert info.prefill_seconds <= info.step_seconds
        assert info.draft_seconds > 0 and info.schedule_seconds > 0 and info.target_seconds > 0  # all measured
    assert infos[0].drafted and infos[0].lengths == [3, 1]
    assert all((r.rounds[0].draft_len, r.rounds[0].accepted) == (0, 0) for r in reqs)
    assert infos[0].prefill_tokens == 2  # the prefill feeds both one-token prompts whole (for their first tokens)
    assert all(info.prefill_tokens == 0 for info in infos[1:])


def test_no_cost_observation_without_online_cost():
    cost = recording_cost("ragged")
    engine, infos = make_engine(ScriptedDrafter(gamma=3, conf=[0.9, 0.8, 0.7]), "dspark", cost, online_cost=False)
    run(engine, [Request([0], max_tokens=5)])
    assert infos and cost.seen == []


def test_fixed_policy_budget_counts_tokens_in_the_cost_models_layout():
    """3 rows of 3 drafts, budget 7: ragged N = 3 + Σℓ allows [2, 1, 1]; padded N = 3·(1 + max ℓ) only [1, 1, 1]."""
    for layout, lengths in (("ragged", [2, 1, 1]), ("padded", [1, 1, 1])):
        cost = recording_cost(layout)
        engine, infos = make_engine(ScriptedDrafter(gamma=3), "fixed", cost, token_budget=7)
        run(engine, [Request([t], max_tokens=9) for t in range(3)])
        assert infos[0].lengths == lengths
        assert infos[0].expected_throughput is None and infos[0].capacity is None


def test_no_drafting_call_when_no_round_drafts():
    drafter = ScriptedDrafter(gamma=3)
    engine, infos = make_engine(drafter, "none")
    run(engine, [Request([0], max_tokens=4)])  # the prefill's token, then 3 rounds (2 with drafting budget)
    assert drafter.calls == 0 and [i.drafted for i in infos] == [False] * 3
    drafter = ScriptedDrafter(gamma=3)
    engine, infos = make_engine(drafter, "dspark", recording_cost("ragged"), record_signals=True)
    req = Request([0], max_tokens=4, max_draft=0)  # speculation off: nothing to draft
    run(engine, [req])
    assert drafter.calls == 0 and all(not i.drafted for i in infos)
    assert all(i.expected_throughput is None and i.capacity is None for i in infos)
    assert all(r.signals is None and r.draft_len == 0 for r in req.rounds)
    assert engine.scheduler._history == type(engine.scheduler._history)(maxlen=2)  # never planned


class FakeOnline:
    """An online calibrator that answers a fixed survival and records what it is told."""

    def __init__(self, survival):
        self.a = survival
        self.asked = []
        self.seen = []

    def survival(self, signals, lengths, temperatures, workloads):
        self.asked.append((signals.shape, lengths.tolist(), list(temperatures), list(workloads)))
        return self.a[: signals.shape[0], : signals.shape[1]].clone()

    def observe_step(self, signals, available, accepted, greedy, workloads, request_ids, temperatures):
        assert signals.dim() == 3 and len(available) == len(signals)  # one call per step, a row per round
        for r, n in enumerate(available):
            self.seen.append((signals[r, :n].clone(), n, accepted[r], greedy[r], workloads[r], request_ids[r],
                              temperatures[r]))


def test_online_calibrator_gets_survival_questions_and_every_verified_prefix():
    a = torch.tensor([[0.9, 0.6, 0.3]] * 3)  # threshold 0.5: two drafts where the limits allow
    online = FakeOnline(a)
    drafter = ScriptedDrafter(gamma=3, good=lambda seq: 1, with_probs=True, conf=[0.9, 0.8, 0.7])
    engine, infos = make_engine(drafter, "threshold:0.5", online=online)
    # max_tokens 5: after the prefill's token, round 1 may draft 3
    reqs = [Request([0], max_tokens=5, max_draft=0, workload="w0"),
            Request([2], SamplingParams(temperature=0.8, seed=5), max_tokens=5, max_draft=1, workload="w1"),
            Request([5], max_tokens=5, workload="w2")]
    run(engine, reqs)
    first = online.asked[0]
    assert first == ((3, 3, 3), [0, 1, 3], [0.0, 0.8, 0.0], ["w0", "w1", "w2"])
    assert infos[0].lengths == [0, 1, 2]
    block = drafter.blocks[0]
    signals = block_signals(DraftBlock(block.tokens, torch.tensor([0, 1, 3]), block.probs, block.confidences),
                            torch.tensor([True, False, True]))
    observed = [s for s in online.seen[:2]]
    assert [(n, acc, g, w, i, t) for _, n, acc, g, w, i, t in observed] == [
        (1, reqs[1].rounds[1].accepted, False, "w1", reqs[1].seq, 0.8), (2, 1, True, "w2", reqs[2].seq, 0.0)]
    torch.testing.assert_close(observed[0][0], signals[1, :1], equal_nan=True)
    torch.testing.assert_close(observed[1][0], signals[2, :2], equal_nan=True)
    assert torch.isnan(observed[1][0][:, 1:]).all()  # a greedy row's q signals do not exist
    assert len(online.seen) == sum(1 for r in reqs for rs in r.rounds if rs.draft_len > 0)


def test_recorded_signals_are_the_blocks_signals_within_the_budget():
    drafter = ScriptedDrafter(gamma=3, good=lambda seq: 3, with_probs=True, conf=[0.9, 0.8, 0.7])
    engine, infos = make_engine(drafter, "fixed", record_signals=True)
    reqs = [Request([0], max_tokens=4), Request([1], SamplingParams(temperature=1.0, seed=2), max_tokens=9)]
    run(engine, reqs)
    block = drafter.blocks[0]
    signals = block_signals(block, torch.tensor([True, False]))
    assert all(r.rounds[0].signals is None for r in reqs)  # the prefill's token: no block, no signals
    assert len(reqs[0].rounds[1].signals) == 2  # max_tokens 4, one token from the prefill: two drafts available
    torch.testing.assert_close(torch.tensor(reqs[0].rounds[1].signals), signals[0, :2], equal_nan=True)
    torch.testing.assert_close(torch.tensor(reqs[1].rounds[1].signals), signals[1, :3], equal_nan=True)
    assert math.isnan(reqs[0].rounds[1].signals[0][1]) and not math.isnan(reqs[1].rounds[1].signals[0][1])
    engine, _ = make_engine(ScriptedDrafter(gamma=3, conf=[0.9, 0.8, 0.7]), "fixed")
    req = Request([0], max_tokens=5)
    run(engine, [req])
    assert all(r.signals is None for r in req.rounds)


class FixedCalibration:
    """A drafter calibration: survival [R, γ] from the block's signals (records what it is asked)."""

    def __init__(self):
        self.asked = []

    def survival(self, signals, lengths, temperatures, workloads):
        self.asked.append((list(temperatures), list(workloads)))
        return torch.tensor([[0.9, 0.7, 0.2]] * signals.shape[0])


def test_drafter_calibration_steers_the_threshold_policy():
    cal = FixedCalibration()
    engine, infos = make_engine(ScriptedDrafter(gamma=3, conf=[0.99, 0.99, 0.99], calibration=cal), "threshold:0.5")
    run(engine, [Request([0], max_tokens=9, workload="code"),
                 Request([1], SamplingParams(temperature=0.7, seed=1), max_tokens=9)])
    assert infos[0].lengths == [2, 2]  # the default map of confidences 0.99 would verify all three
    assert cal.asked[0] == ([0.0, 0.7], ["code", None])


class RecordingScheduler(Scheduler):
    def __init__(self, spec, gamma):
        super().__init__(spec, gamma)
        self.ids = []

    def plan(self, survival, limits, cost=None, token_budget=None, request_ids=None):
        self.ids.append(None if request_ids is None else list(request_ids))
        return super().plan(survival, limits, cost, token_budget, request_ids)


def test_adaptive_plans_get_the_requests_ids_and_the_token_budget():
    cal = FixedCalibration()
    sched = RecordingScheduler("threshold:0.5", gamma=3)
    drafter = ScriptedDrafter(gamma=3, conf=[0.9, 0.9, 0.9], calibration=cal)
    engine, infos = make_engine(drafter, sched, token_budget=7)
    reqs = [Request([t], max_tokens=6 + 2 * t) for t in range(3)]
    run(engine, reqs)
    assert infos[0].lengths == [1, 1, 1]  # threshold gives 2 each; padded N = 3·(1 + max ℓ) ≤ 7 allows 1
    assert sched.ids[0] == [r.seq for r in reqs]
    assert [reqs[2].seq, reqs[1].seq] in sched.ids  # after the first one left (the last row took its place): ids
    assert len(sched.ids) == sum(i.drafted for i in infos)  # one plan per drafted round


# ------------------------------------------------------------------------------------------------------
# a drafting fault


def test_a_row_whose_drafting_raises_fails_alone_and_the_round_goes_on_without_drafts():
    cost = recording_cost("ragged")
    drafter = ScriptedDrafter(gamma=2, conf=[0.9, 0.8], fail=lambda seq: seq[0] == 7)
    engine, infos = make_engine(drafter, "dspark", cost)
    bad, good = Request([7, 7], max_tokens=4), Request([1], max_tokens=4)
    for req in (bad, good):
        engine.add(req)
    first = engine.step()  # the prefill commits each row's first token, then bad's drafting raises
    assert [(o.request is bad, o.token_ids, o.finished) for o in first] == [(True, [0], True), (False, [2, 3], False)]
    assert bad.finish_reason == "error" and "poisoned row" in bad.error
    assert infos[0].drafted is False and infos[0].batch == 1 and infos[0].lengths == [0]
    assert cost.seen == []  # a faulted round is no measurement of a plain step
    while engine.has_work:
        engine.step()
    assert good.output_ids == chain(1, 4) and len(cost.seen) == len(infos) - 1
    engine, infos = make_engine(ScriptedDrafter(gamma=2, fail=lambda seq: True), "fixed")
    alone = Request([3], max_tokens=4)
    engine.add(alone)
    outs = engine.step()
    assert [(o.request is alone, o.token_ids, o.finished) for o in outs] == [(True, [4], True)]
    assert alone.finish_reason == "error"
    assert infos == [] and not engine.has_work


# ------------------------------------------------------------------------------------------------------
# where the round's tensors live


class OnItsDevice:
    """Wraps a target or a drafter so that its own methods run with torch's default device set to its device,
    as a model on a GPU makes its tensors where it lives whatever the default device is."""

    def __init__(self, inner, device="cpu"):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_device", device)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value) or isinstance(value, torch.nn.Module):
            return value

        def call(*args, **kwargs):
            with torch.device(self._device):
                out = value(*args, **kwargs)
            return OnItsDevice(out, self._device) if name == "empty_like" else out

        return call

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def test_rounds_make_their_tensors_on_the_targets_device_not_torchs_default():
    """Under another default device ("meta", a CPU stand-in for `torch.set_default_device("cuda")` beside a
    CPU target, or for the default CPU beside a GPU target) drafted and plain rounds commit the same tokens: the
    empty block of a plain round and the accepted counts the target cache keeps are made on the target's device."""
    drafter = OnItsDevice(ScriptedDrafter(gamma=2, good=lambda seq: 2 if len(seq) == 2 else 0))
    engine = Engine(OnItsDevice(chain_target()), drafter, "fixed", config=EngineConfig(detokenize=False),
                    eos_token_ids=frozenset())
    req = engine.add(Request([0], SamplingParams(seed=1), max_tokens=5))
    with torch.device("meta"):
        while engine.has_work:
            engine.step()
    assert (req.output_ids, req.finish_reason) == (chain(0, 5), "length")
    # the prefill's pass commits token 1 (a verify without drafts); round 1 verifies two drafts and accepts both;
    # round 2 has no draft budget left: a plain round
    assert [(rs.draft_len, rs.accepted) for rs in req.rounds] == [(0, 0), (2, 2), (0, 0)]


def test_the_engine_teaches_the_cost_model_each_steps_overhead_but_not_idle_time():
    """Between two steps that ran rounds, the time outside the first one's round (its prefill and bookkeeping,
    the wait until the next step) is the step's overhead; a wait far longer than a round is idleness."""
    cost = uniform_cost_model(gamma=2, batches=(1, 2, 4), per_token=0.01)
    seen = []
    cost.observe_overhead = lambda seconds, rows, tokens, prefill: seen.append((seconds, rows, tokens, prefill))
    engine, infos = make_engine(ScriptedDrafter(gamma=2), "fixed", cost)
    run(engine, [Request([0], max_tokens=12), Request([1], max_tokens=12)])
    # every step after the first ran a round while both rows were running, except after the last round
    assert len(seen) >= len(infos) - 2 > 0
    assert all(o >= p >= 0 and rows in (1, 2) and tokens >= rows for o, rows, tokens, p in seen)
    idle = uniform_cost_model(gamma=2, batches=(1, 2, 4), per_token=0.01)
    engine, _ = make_engine(ScriptedDrafter(gamma=2), "fixed", idle)
    engine.add(Request([0], max_tokens=12))
    engine.step()
    engine._last_round = (engine._last_round[0] - 100.0, *engine._last_round[1:])  # as if it idled 100 s since
    engine.step()
    assert idle.overhead.steps == 0
    quiet = uniform_cost_model(gamma=2, batches=(1, 2, 4), per_token=0.01)
    engine, _ = make_engine(ScriptedDrafter(gamma=2), "fixed", quiet, online_cost=False)
    run(engine, [Request([0], max_tokens=12)])
    assert quiet.overhead.steps == 0


def test_a_step_whose_plan_does_not_pay_verifies_the_whole_block_and_feeds_no_calibration():
    """On a flat cost curve Algorithm 1 never cuts, so once its own work is measured the engine skips planning
    (`Scheduler.plan_pays`): those steps verify every available draft, compute no survival and give the online
    calibrator nothing; every PLAN_REFRESH steps one plans again. The output is the target's greedy chain."""
    from dspark.calibration.maps import ConstantMap
    from dspark.calibration.online import OnlineCalibrator

    flat = CostModel({1: [(n, 1.0) for n in range(1, 5)]}, {1: 3.0}, "padded")
    online = OnlineCalibrator(ConstantMap([0.9] * 3), 3)
    drafter = ScriptedDrafter(gamma=3, good=lambda seq: 1, conf=[0.9, 0.8, 0.7])
    engine, infos = make_engine(drafter, "dspark", flat, online=online, online_cost=False)
    req = Request([0], max_tokens=60)
    run(engine, [req])
    planned = [i for i in infos if i.planned]
    skipped = [i for i in infos if i.drafted and not i.planned]
    assert planned and skipped and engine.scheduler.skipped_plans == len(skipped)
    assert all(i.lengths == [r.available] for i, r in zip(infos, req.rounds[1:]) if not i.planned and i.drafted)
    assert all(i.capacity is None and i.expected_throughput is None for i in skipped)
    assert online.counts["observed"] == len(planned)  # one row: a round per planned step
    run_of_skips = max(len(list(g)) for k, g in itertools.groupby(i.planned for i in infos if i.drafted) if not k)
    assert run_of_skips <= Scheduler.PLAN_REFRESH
    assert req.output_ids == chain(req.prompt_ids[-1], 60)
