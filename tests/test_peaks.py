"""Greedy rows' peaks: the non-anticipating view of a greedy drafter's certainty that survival maps read at T 0.

A greedy row's q is one-hot, so its max is 1 whatever the drafter believed. `DraftBlock.peaks` carries
max_x softmax(ℓ_k)(x) of the drafting logits at temperature 1 instead; `block_signals` puts it in the MAX_Q
channel of greedy rows, and a logistic map fitted on greedy rounds then tells easy rows from hard ones.
"""
from __future__ import annotations

import math

import pytest
import torch

import dspark
from dspark.api import encode_prompt
from dspark.calibration.fit import fit_logistic
from dspark.calibration.maps import BinnedMap, Calibration, ConstantMap, LogisticMap
from dspark.calibration.metrics import auroc
from dspark.calibration.records import RoundRecords
from dspark.calibration.signals import ENTROPY, MAX_Q, block_signals
from dspark.decoding import decode
from dspark.sampling import BatchSampling, SamplingParams, greedy_peaks

DRAFTERS = ["dspark", "dspark-rnn", "dflash", "eagle3", "draft-model"]


def test_greedy_peaks_are_the_softmax_max_of_greedy_rows_only() -> None:
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)) * 3
    greedy = torch.tensor([True, False, True])
    peaks = greedy_peaks(logits, greedy)
    expect = torch.softmax(logits, -1).amax(-1)
    assert torch.allclose(peaks[greedy], expect[greedy], atol=1e-6)
    assert bool(torch.isnan(peaks[1]).all())
    assert greedy_peaks(logits, torch.zeros(3, dtype=torch.bool)) is None
    every = greedy_peaks(logits.to(torch.bfloat16), torch.ones(3, dtype=torch.bool))  # all greedy: no row copy
    assert every.dtype == torch.float32 and torch.allclose(every, torch.softmax(logits.to(torch.bfloat16).float(), -1)
                                                           .amax(-1), atol=1e-6)


def propose(drafter, target, ids, params: list[SamplingParams], peaks: bool = True):
    drafter.report_peaks = peaks
    n = len(params)
    target.reset(1)
    target.set_feature_layers(drafter.feature_layers)
    feats = target.forward([ids[:-1]], features=True).features if drafter.feature_layers else None
    drafter.start([ids] * n, None if feats is None else feats.expand(n, -1, -1))
    sampling = BatchSampling.from_params(params, "cpu")
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return drafter.propose([ids] * n, sampling, gens), sampling


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_bundled_drafter_reports_greedy_peaks(bundled_target, name) -> None:
    drafter = dspark.load_drafter(name, bundled_target, gamma=3)
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    mixed, sampling = propose(drafter, bundled_target, ids, [greedy, sampled])
    assert mixed.peaks is not None and mixed.peaks.shape == (2, 3)
    assert bool(((mixed.peaks[0] > 0) & (mixed.peaks[0] <= 1)).all())
    assert bool(torch.isnan(mixed.peaks[1]).all())
    # slot 0 does not depend on earlier drafts: the greedy row's peak is the sampled T 1 row's max q there
    assert math.isclose(float(mixed.peaks[0, 0]), float(mixed.probs[1, 0].max()), rel_tol=1e-4)
    # the greedy-only path (one-hot or no q) reports the same peaks as the greedy row of a mixed batch
    alone, _ = propose(drafter, bundled_target, ids, [greedy])
    assert torch.equal(alone.tokens[0], mixed.tokens[0])
    assert torch.allclose(alone.peaks[0], mixed.peaks[0], atol=1e-5)
    signals = block_signals(mixed, sampling.greedy)
    assert torch.allclose(signals[0, :, MAX_Q], mixed.peaks[0])
    assert bool(torch.isnan(signals[0, :, ENTROPY]).all())
    assert torch.allclose(signals[1, :, MAX_Q], mixed.probs[1].amax(-1))


def test_candidate_drafting_takes_the_peak_over_its_candidates(bundled_target) -> None:
    drafter = dspark.load_drafter("dspark", bundled_target, gamma=3)
    drafter.bias_candidates = 8
    ids = encode_prompt(bundled_target, "def fib(n):")
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    mixed, _ = propose(drafter, bundled_target, ids, [greedy, sampled])
    alone, _ = propose(drafter, bundled_target, ids, [greedy])
    assert math.isclose(float(mixed.peaks[0, 0]), float(mixed.probs[1, 0].max()), rel_tol=1e-4)
    assert torch.allclose(alone.peaks[0], mixed.peaks[0], atol=1e-5)


def test_a_logistic_map_fitted_on_greedy_peaks_discriminates() -> None:
    gen = torch.Generator().manual_seed(3)
    n, gamma = 6000, 3
    peak = 0.2 + 0.8 * torch.rand(n, gamma, generator=gen)
    accept = torch.rand(n, gamma, generator=gen) < peak  # a greedy draft survives with its peak's probability
    accepted = torch.cumprod(accept.long(), 1).sum(1)
    signals = torch.full((n, gamma, 3), float("nan"))
    signals[..., MAX_Q] = peak
    records = RoundRecords(signals, torch.full((n,), gamma), accepted, torch.ones(n, dtype=torch.bool))
    fitted = fit_logistic(records)
    assert all(w[1] > 0.5 for w in fitted.weights)  # survival rises with the peak
    cond = fitted.conditional(signals)
    labels, valid = records.conditional_labels()
    assert auroc(cond[:, 0], labels[:, 0].double()) > 0.65
    without = signals.clone()
    without[..., MAX_Q] = float("nan")  # a drafter without peaks gets the position's prior: one value per position
    assert torch.unique(fitted.conditional(without)[:, 0]).numel() == 1


def test_peaks_are_computed_only_when_recorded_or_read(bundled_target) -> None:
    """A peak costs a pass over the vocabulary per draft: drafters skip it unless the engine records signals
    or the drafter's calibration has a greedy map that reads it."""
    drafter = dspark.load_drafter("dflash", bundled_target, gamma=3)
    greedy = SamplingParams(temperature=0.0)
    ids = encode_prompt(bundled_target, "def fib(n):")
    assert propose(drafter, bundled_target, ids, [greedy], peaks=False)[0].peaks is None
    assert propose(drafter, bundled_target, ids, [greedy])[0].peaks is not None
    assert drafter.calibration.greedy_reads_q is False  # the shipped T 0 maps give greedy rows a prior
    decode(bundled_target, drafter, [ids], [greedy], 4)
    assert drafter.report_peaks is False
    decode(bundled_target, drafter, [ids], [greedy], 4, record_signals=True)
    assert drafter.report_peaks is True
    reading = Calibration({0.0: BinnedMap(LogisticMap([1.0], [[1.0, 2.0, 0.0]]), [[]], [[0.8]])})
    assert reading.greedy_reads_q and not Calibration({0.0: ConstantMap([0.7])}).greedy_reads_q
    drafter.calibration = reading
    decode(bundled_target, drafter, [ids], [greedy], 4)
    assert drafter.report_peaks is True


def test_sampled_rows_q_signals_are_computed_only_when_a_map_reads_them(bundled_target) -> None:
    """A sampled row's max q and entropy read the whole vocabulary at every draft: the engine computes them
    only where the survival maps (the online calibrator's prior) read them or signals are recorded."""
    from dspark.calibration.online import OnlineCalibrator
    from dspark.engine import Engine, EngineConfig, Request

    class Recording(OnlineCalibrator):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.signals: list[torch.Tensor] = []

        def observe_step(self, signals, available, *a, **k) -> int:
            self.signals.extend(signals[r, :n].clone() for r, n in enumerate(available))
            return super().observe_step(signals, available, *a, **k)

    drafter = dspark.load_drafter("dspark", bundled_target, gamma=3)
    ids = encode_prompt(bundled_target, "Write a poem about the sea.")
    reading = Calibration({0.0: ConstantMap([0.7] * 3),
                           1.0: LogisticMap([0.5] * 3, [[0.0, 1.0, 0.1]] * 3)})
    assert drafter.calibration.reads_q is False and reading.reads_q
    for prior, computed in ((drafter.calibration, False), (reading, True)):
        online = Recording(prior, 3)
        engine = Engine(bundled_target, drafter, "threshold:0.3", None, EngineConfig(), online)
        engine.run([Request(ids, SamplingParams(temperature=1.0, seed=1), max_tokens=12)])
        assert online.signals
        for s in online.signals:
            assert bool(torch.isfinite(s[:, 0]).all())  # the head logit is always there
            assert bool(torch.isfinite(s[:, MAX_Q:]).all()) == computed
            assert bool(torch.isnan(s[:, MAX_Q:]).all()) != computed
