"""Survival maps, their fitting and calibration metrics on synthetic rounds with a known ground truth."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from dspark.calibration.fit import (
    default_temperature_grid,
    fit_head_logistic,
    fit_logistic,
    fit_map,
    fit_sequential_temperature,
)
from dspark.calibration.maps import (
    BinnedMap,
    Calibration,
    ConstantMap,
    HeadLogisticMap,
    HeadTemperatureMap,
    LogisticMap,
    default_map,
    map_from_dict,
)
from dspark.calibration.metrics import (
    auroc,
    brier,
    calibration_report,
    ece,
    ece_std_error,
    format_report_table,
    log_loss,
    reliability_diagram,
)
from dspark.calibration.records import RoundRecords

NAN = float("nan")


def chain_accepted(p: torch.Tensor, available: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Accepted drafts per round when draft k survives with conditional probability p[:, k]."""
    survive = torch.rand(p.shape, generator=gen, dtype=torch.float64) < p
    k = torch.arange(p.shape[1]).view(1, -1)
    survive &= k < available.view(-1, 1)
    return torch.cumprod(survive.long(), dim=1).sum(1)


def random_available(n: int, gamma: int, gen: torch.Generator) -> torch.Tensor:
    available = torch.randint(1, gamma + 1, (n,), generator=gen)
    available[torch.rand(n, generator=gen) < 0.6] = gamma
    return available


def head_records(n: int = 20000, t_true: tuple[float, ...] = (2.5, 0.5, 1.6, 3.0), seed: int = 0) -> RoundRecords:
    """Rounds whose confidence logits are logit(p_k)·T_k: the raw head is miscalibrated, STS with T_k fixes it."""
    gen = torch.Generator().manual_seed(seed)
    gamma = len(t_true)
    z = torch.randn(n, gamma, generator=gen, dtype=torch.float64) * 1.5 + 1.0
    available = random_available(n, gamma, gen)
    accepted = chain_accepted(torch.sigmoid(z), available, gen)
    signals = torch.full((n, gamma, 3), NAN)
    signals[..., 0] = (z * torch.tensor(t_true, dtype=torch.float64)).float()
    domains = ["code" if i % 3 == 0 else "chat" for i in range(n)]
    return RoundRecords(signals, available, accepted, torch.ones(n, dtype=torch.bool), domains)


W_TRUE = ((2.0, 1.5, -0.6), (1.0, 2.0, -0.3), (0.5, 1.0, -0.8))
PRIOR_TRUE = (0.8, 0.9, 0.6)


def logistic_records(n: int = 20000, seed: int = 1) -> RoundRecords:
    """Rounds from a known logistic model of (log max_q, entropy); 30% greedy rows with a per-position prior."""
    gen = torch.Generator().manual_seed(seed)
    gamma = len(W_TRUE)
    max_q = 0.05 + 0.94 * torch.rand(n, gamma, generator=gen, dtype=torch.float64)
    entropy = (1 - max_q) * (0.5 + 3.0 * torch.rand(n, gamma, generator=gen, dtype=torch.float64))
    w = torch.tensor(W_TRUE, dtype=torch.float64)
    p = torch.sigmoid(w[:, 0] + w[:, 1] * torch.log(max_q) + w[:, 2] * entropy)
    greedy = torch.rand(n, generator=gen) < 0.3
    p[greedy] = torch.tensor(PRIOR_TRUE, dtype=torch.float64)
    available = random_available(n, gamma, gen)
    accepted = chain_accepted(p, available, gen)
    signals = torch.full((n, gamma, 3), NAN)
    signals[..., 1] = max_q.float()
    signals[..., 2] = entropy.float()
    signals[greedy, :, 1:] = NAN
    return RoundRecords(signals, available, accepted, greedy)


def pooled(report: dict, kind: str = "cumulative", domain: str = "all", metric: str = "ece") -> float:
    return report["domains"][domain][kind]["pooled"][metric]


# ---------------------------------------------------------------- metrics


def test_ece_of_calibrated_predictions_is_small_and_of_a_constant_is_the_gap() -> None:
    gen = torch.Generator().manual_seed(0)
    pred = torch.rand(200000, generator=gen, dtype=torch.float64)
    label = (torch.rand(200000, generator=gen, dtype=torch.float64) < pred).double()
    assert ece(pred, label) < 0.01
    wrong = torch.full((1000,), 0.8, dtype=torch.float64)
    label = torch.zeros(1000)
    label[:600] = 1.0
    assert ece(wrong, label) == pytest.approx(0.2, abs=1e-9)
    assert ece(np.full(1000, 0.8), label.numpy()) == pytest.approx(0.2, abs=1e-9)


def test_ece_bins_are_half_open_with_the_last_closed() -> None:
    # 0.04 and 0.06 fall in different bins ([0, .05) and [.05, .1)): (|1 − .04| + |0 − .06|) / 2.
    assert ece([0.04, 0.06], [1.0, 0.0]) == pytest.approx(0.51)
    # 0.96 and 1.0 share the last bin [.95, 1]: |0.5 − 0.98|.
    assert ece([0.96, 1.0], [0.0, 1.0]) == pytest.approx(0.48)
    assert math.isnan(ece([], []))


def test_brier_and_log_loss_on_hand_computed_examples() -> None:
    assert brier([0.2, 0.9], [0.0, 1.0]) == pytest.approx((0.04 + 0.01) / 2)
    assert log_loss([0.2, 0.9], [0.0, 1.0]) == pytest.approx(-(math.log(0.8) + math.log(0.9)) / 2)
    assert log_loss([0.0], [1.0]) == pytest.approx(-math.log(1e-6))
    assert log_loss([1.0, 0.5], [1.0, 0.0]) == pytest.approx((-math.log1p(-1e-6) + math.log(2)) / 2)
    with pytest.raises(ValueError, match="differ in length"):
        brier([0.1, 0.2], [1.0])


def test_auroc_matches_a_pairwise_count_with_ties() -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        pred = rng.integers(0, 6, size=80) / 5.0  # many ties
        label = (rng.random(80) < 0.4).astype(float)
        pos, neg = pred[label == 1], pred[label == 0]
        pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a, b in itertools.product(pos, neg)]
        assert auroc(pred, label) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert auroc([0.1, 0.9], [0.0, 1.0]) == 1.0
    assert math.isnan(auroc([0.3, 0.4], [1.0, 1.0]))


# ---------------------------------------------------------------- maps


@pytest.mark.parametrize("survival_map", [
    HeadTemperatureMap([0.7, 1.3, 2.0]),
    LogisticMap([0.5, 0.2, -0.1], [[1.0, 0.5, -0.2], [0.8, 0.3, -0.4], [0.2, 1.0, -0.1]]),
    ConstantMap([0.9, 0.8, 0.7]),
    HeadLogisticMap([[0.1, 0.9], [0.0, 1.2], [-0.3, 0.7]], [[1.0, 0.8, 0.5, -0.2], [0.5, 1.0, 0.3, -0.4],
                                                           [0.2, 0.6, 1.0, -0.1]]),
])
def test_survival_is_monotone_and_zero_beyond_available(survival_map) -> None:
    gen = torch.Generator().manual_seed(2)
    n, gamma = 64, 5  # wider than the fitted 3 positions
    signals = torch.randn(n, gamma, 3, generator=gen) * 2
    signals[..., 1] = torch.rand(n, gamma, generator=gen).clamp_min(0.01)
    signals[::3, :, 1:] = NAN  # greedy rows
    available = torch.randint(0, gamma + 1, (n,), generator=gen)
    c = survival_map.conditional(signals)
    assert c.shape == (n, gamma) and bool(((c > 0) & (c < 1)).all())
    a = survival_map.survival(signals, available)
    k = torch.arange(1, gamma + 1).view(1, -1)
    beyond = k > available.view(-1, 1)
    assert bool((a[beyond] == 0).all())
    assert bool((a[~beyond] > 0).all())
    assert bool((a[:, 1:] <= a[:, :-1]).all())
    assert torch.allclose(a[~beyond], torch.cumprod(c, 1)[~beyond])


def test_positions_past_the_fitted_length_reuse_the_last_parameters() -> None:
    signals = torch.full((2, 4, 3), NAN)
    signals[..., 0] = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0]])
    c = HeadTemperatureMap([1.0, 2.0]).conditional(signals)
    assert torch.allclose(c, torch.sigmoid(signals[..., 0] / torch.tensor([1.0, 2.0, 2.0, 2.0])))
    const = ConstantMap([0.9, 0.6]).conditional(signals)
    assert torch.allclose(const, torch.tensor([0.9, 0.6, 0.6, 0.6]).expand(2, 4))


def test_logistic_map_uses_the_prior_for_greedy_rows() -> None:
    m = LogisticMap([1.0], [[0.5, 2.0, -1.0]])
    signals = torch.full((2, 2, 3), NAN)
    signals[0, :, 1] = 0.5
    signals[0, :, 2] = 0.7
    c = m.conditional(signals)
    expected = torch.sigmoid(torch.tensor(0.5 + 2.0 * math.log(0.5) - 0.7))
    assert torch.allclose(c[0], expected.expand(2))
    assert torch.allclose(c[1], torch.sigmoid(torch.tensor(1.0)).expand(2))


def test_head_temperature_map_without_a_head_fails_clearly() -> None:
    with pytest.raises(ValueError, match="no confidence head"):
        HeadTemperatureMap([1.0]).conditional(torch.full((3, 2, 3), NAN))
    with pytest.raises(ValueError, match="positive"):
        HeadTemperatureMap([1.0, 0.0])
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        ConstantMap([1.2])


def test_head_map_allows_nan_padding_past_available() -> None:
    signals = torch.full((2, 3, 3), NAN)
    signals[0, :, 0] = torch.tensor([1.0, 2.0, 3.0])
    signals[1, :1, 0] = 0.5  # one draft, padding after it
    m = HeadTemperatureMap([2.0])
    a = m.survival(signals, torch.tensor([3, 1]))
    assert torch.allclose(a[0], torch.cumprod(torch.sigmoid(torch.tensor([0.5, 1.0, 1.5])), 0))
    assert float(a[1, 0]) == pytest.approx(1 / (1 + math.exp(-0.25))) and bool((a[1, 1:] == 0).all())
    with pytest.raises(ValueError, match="no confidence head"):
        m.survival(signals, torch.tensor([3, 2]))
    records = RoundRecords(signals, torch.tensor([3, 1]), torch.tensor([2, 1]), torch.zeros(2, dtype=torch.bool))
    assert calibration_report(records, m)["domains"]["all"]["cumulative"]["pooled"]["count"] == 4


def test_default_map_depends_on_the_head() -> None:
    assert isinstance(default_map(True, 4), HeadTemperatureMap) and default_map(True, 4).temperatures == [1.0] * 4
    constant = default_map(False, 3)
    assert isinstance(constant, ConstantMap) and constant.values == [0.7] * 3


# ---------------------------------------------------------------- fitting


def test_default_grid_is_geometric_and_contains_one() -> None:
    grid = default_temperature_grid()
    assert grid.numel() == 241 and float(grid[0]) == pytest.approx(0.05) and float(grid[-1]) == pytest.approx(20.0)
    assert bool((grid == 1.0).any())
    ratios = grid[1:] / grid[:-1]
    assert float(ratios.max() - ratios.min()) < 1e-6


def test_sequential_temperature_scaling_recovers_temperatures_and_calibrates() -> None:
    t_true = (2.5, 0.5, 1.6, 3.0)
    records = head_records(t_true=t_true)
    fitted = fit_sequential_temperature(records)
    for t_fit, t in zip(fitted.temperatures, t_true, strict=True):
        assert abs(math.log(t_fit / t)) < 0.2, (fitted.temperatures, t_true)
    before = calibration_report(records, default_map(True, records.gamma))
    after = calibration_report(records, fitted)
    for domain in ("all", "chat", "code"):
        assert before["headline_ece"][domain] > 0.04
        assert after["headline_ece"][domain] < 0.02
    assert pooled(after, metric="log_loss") < pooled(before, metric="log_loss")
    assert isinstance(fit_map(records, has_head=True, method="sts"), HeadTemperatureMap)
    assert isinstance(fit_map(records, has_head=True).base, HeadTemperatureMap)  # binned on top by default
    with pytest.raises(ValueError, match="no confidence head"):
        fit_sequential_temperature(logistic_records(n=200))


def test_sequential_temperature_ties_prefer_one() -> None:
    # Every candidate scores the same ECE when all logits are 0 (sigmoid = ½ for any T).
    signals = torch.full((50, 2, 3), NAN)
    signals[..., 0] = 0.0
    records = RoundRecords(signals, torch.full((50,), 2), torch.randint(0, 3, (50,)), torch.zeros(50, dtype=bool))
    assert fit_sequential_temperature(records, grid=[0.5, 0.9, 1.2, 3.0]).temperatures == [0.9, 0.9]


def test_logistic_fit_recovers_the_model_and_beats_a_constant() -> None:
    records = logistic_records()
    fitted = fit_logistic(records)
    assert isinstance(fit_map(records, has_head=False, method="sts"), LogisticMap)
    assert isinstance(fit_map(records, has_head=False).base, LogisticMap)
    for w_fit, w in zip(fitted.weights, W_TRUE, strict=True):
        assert np.allclose(w_fit, w, atol=0.35), (fitted.weights, W_TRUE)
    for prior_fit, prior in zip(fitted.prior, PRIOR_TRUE, strict=True):
        assert abs(1 / (1 + math.exp(-prior_fit)) - prior) < 0.03
    report = calibration_report(records, fitted)
    assert pooled(report) < 0.02 and pooled(report, "conditional") < 0.02
    labels, valid = records.conditional_labels()
    means = ((labels * valid).sum(0) / valid.sum(0)).tolist()  # the best constant per position
    for constant in (default_map(False, records.gamma), ConstantMap(means)):
        base = calibration_report(records, constant)
        assert pooled(report, metric="log_loss") < pooled(base, metric="log_loss") - 0.02
        assert pooled(report, "conditional", metric="log_loss") < pooled(base, "conditional", metric="log_loss")
    assert pooled(report, metric="auroc") > 0.7


def test_logistic_fit_handles_positions_without_rows_or_without_sampled_rows() -> None:
    signals = torch.full((40, 3, 3), NAN)  # an n-gram drafter: no q at all
    available = torch.full((40,), 2)
    accepted = torch.tensor([2] * 30 + [0] * 10)
    fitted = fit_logistic(RoundRecords(signals, available, accepted, torch.zeros(40, dtype=bool)))
    assert fitted.prior[0] == pytest.approx(math.log(31 / 11))
    assert fitted.weights[0] == [fitted.prior[0], 0.0, 0.0]
    assert fitted.prior[2] == fitted.prior[1] and fitted.weights[2] == fitted.weights[1]  # no rows at k = 3


# ---------------------------------------------------------------- reports


def joint_records(n: int = 20000, seed: int = 4) -> RoundRecords:
    """Rounds whose conditional survival sigmoid(0.5 + 1.2·logit + 2·log peak) reads the head and the peak."""
    gen = torch.Generator().manual_seed(seed)
    gamma = 3
    signals = torch.full((n, gamma, 3), NAN)
    signals[..., 0] = torch.randn(n, gamma, generator=gen)
    signals[..., 1] = 0.1 + 0.9 * torch.rand(n, gamma, generator=gen)  # greedy rows' peaks
    p = torch.sigmoid(0.5 + 1.2 * signals[..., 0] + 2.0 * torch.log(signals[..., 1]))
    available = random_available(n, gamma, gen)
    return RoundRecords(signals, available, chain_accepted(p, available, gen), torch.ones(n, dtype=torch.bool))


def test_head_logistic_fit_recovers_both_inputs_and_beats_the_head_alone() -> None:
    records, held = joint_records(), joint_records(seed=5)
    fitted = fit_head_logistic(records)
    for w in fitted.weights:
        assert w[1] == pytest.approx(1.2, abs=0.2) and w[2] == pytest.approx(2.0, abs=0.35)
    labels, valid = held.conditional_labels()
    joint = log_loss(fitted.conditional(held.signals)[valid], labels[valid].double())
    head_only = log_loss(fit_sequential_temperature(records).conditional(held.signals)[valid],
                         labels[valid].double())
    assert joint < head_only - 0.02
    no_peaks = held.signals.clone()
    no_peaks[..., 1] = NAN  # rows without a peak fall back to the rescaled head: one value per head logit
    c = fitted.conditional(no_peaks)
    assert torch.allclose(c[:, 0], torch.sigmoid(fitted.head[0][0] + fitted.head[0][1] * no_peaks[:, 0, 0]).float(),
                          atol=1e-5)
    with pytest.raises(ValueError, match="confidence-head logits"):
        fit_head_logistic(logistic_records())
    assert isinstance(fit_map(records, True, "joint").base, HeadLogisticMap)
    assert isinstance(fit_map(logistic_records(), False, "joint").base, LogisticMap)


def test_head_logistic_map_round_trips_and_names_bad_fields(tmp_path) -> None:
    m = HeadLogisticMap([[0.1, 0.9], [0.0, 1.2]], [[1.0, 0.8, 0.5, -0.2], [0.5, 1.0, 0.3, -0.4]])
    cal = Calibration({0.0: BinnedMap(m, [[0.5], []], [[0.3, 0.8], [0.6]])})
    path = cal.to_json(tmp_path / "cal.json")
    signals, available = mixed_signals()
    assert torch.equal(Calibration.load(path).survival(signals, available, [0.0] * len(signals)),
                       cal.survival(signals, available, [0.0] * len(signals)))
    for mutate, pattern in [(lambda d: d["maps"]["0.0"]["base"]["weights"][0].pop(), r"base\.weights\[0\]"),
                            (lambda d: d["maps"]["0.0"]["base"].pop("head"), r"base\.head"),
                            (lambda d: d["maps"]["0.0"]["base"]["head"].pop(), r"base\.weights")]:
        cal.to_json(path)
        corrupt(path, mutate)
        with pytest.raises(ValueError, match=pattern):
            Calibration.load(path)


def test_calibration_report_is_json_and_consistent() -> None:
    records = head_records(n=3000)
    m = HeadTemperatureMap([2.0, 1.0, 1.0, 2.0])
    report = calibration_report(records, m)
    json.dumps(report, allow_nan=False)
    assert set(report["domains"]) == {"all", "chat", "code"}
    labels, valid = records.cumulative_labels()
    a = m.survival(records.signals, records.available)
    assert report["headline_ece"]["all"] == pytest.approx(ece(a[valid], labels[valid]))
    counts = [report["domains"][d]["cumulative"]["pooled"]["count"] for d in ("chat", "code")]
    assert sum(counts) == pooled(report, metric="count") == int(valid.sum())
    per_pos = report["domains"]["all"]["cumulative"]["per_position"]
    assert [p["position"] for p in per_pos] == [1, 2, 3, 4]
    assert per_pos[0]["count"] == len(records)
    one_class = calibration_report(records.subset(records.accepted == records.available), m)
    assert one_class["domains"]["all"]["cumulative"]["pooled"]["auroc"] is None  # NaN → None

    table = format_report_table(calibration_report(records, default_map(True, 4)), report)
    assert "### chat" in table and "### code" in table and "cumulative ECE k=4" in table
    assert f"{report['headline_ece']['code']:.4f}" in table


def test_reliability_diagram_writes_a_png(tmp_path) -> None:
    records = head_records(n=2000)
    path = reliability_diagram(records, {"before": default_map(True, 4), "after": fit_sequential_temperature(records)},
                               tmp_path / "plots" / "reliability.png", title="synthetic")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000


# ---------------------------------------------------------------- calibration files


def make_calibration() -> Calibration:
    return Calibration(
        maps={0.0: HeadTemperatureMap([1.5, 0.8]), 0.6: LogisticMap([0.3], [[1.0, 0.5, -0.25]]),
              1.0: ConstantMap([0.8, 0.6])},
        drafter="dspark-qwen3-0.6b", target="Qwen/Qwen3-0.6B@abc123",
        metrics={0.0: {"ece_before": 0.1, "ece_after": 0.01, "undefined": NAN}})


def mixed_signals(n: int = 12, gamma: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    signals = torch.randn(n, gamma, 3, generator=gen)
    signals[..., 1] = torch.rand(n, gamma, generator=gen).clamp_min(0.05)
    return signals, torch.randint(0, gamma + 1, (n,), generator=gen)


def test_calibration_json_round_trip_gives_identical_survival(tmp_path) -> None:
    cal = make_calibration()
    path = cal.to_json(tmp_path / "cal.json")
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]  # no temporary file left behind
    data = json.loads(path.read_text())
    assert data["format"] == "dspark-calibration" and data["version"] == 1
    assert set(data["maps"]) == {"0.0", "0.6", "1.0"}
    assert data["maps"]["0.0"]["metrics"]["undefined"] is None
    loaded = Calibration.load(path, expect_drafter=cal.drafter, expect_target=cal.target)
    signals, available = mixed_signals()
    temps = [0.0, 0.6, 1.0, 0.7, 0.0, 2.0, 0.55, 0.0, 1.0, 0.6, 0.9, 0.0]
    assert torch.equal(loaded.survival(signals, available, temps), cal.survival(signals, available, temps))
    assert loaded.metrics[0.0]["ece_after"] == 0.01


def test_calibration_survival_applies_each_rows_map() -> None:
    cal = make_calibration()
    signals, available = mixed_signals()
    temps = torch.tensor([0.0, 0.6, 1.0, 0.7, 0.0, 2.0, 0.55, 0.0, 1.0, 0.6, 0.9, 0.0])
    out = cal.survival(signals, available, temps)
    for r, t in enumerate(temps.tolist()):
        expected = cal.map_for(t).survival(signals[r:r + 1], available[r:r + 1])[0]
        assert torch.equal(out[r], expected)
    same = cal.survival(signals, available, [0.0] * len(signals))
    assert torch.equal(same, cal.maps[0.0].survival(signals, available))


def test_map_for_picks_greedy_or_the_nearest_temperature() -> None:
    cal = make_calibration()
    assert cal.map_for(0.0) is cal.maps[0.0]
    assert cal.map_for(0.7) is cal.maps[0.6]
    assert cal.map_for(0.9) is cal.maps[1.0]
    assert cal.map_for(5.0) is cal.maps[1.0]
    assert cal.map_for(0.01) is cal.maps[0.6]  # sampled rows never take the greedy map while a sampled one exists
    only_sampled = Calibration({0.7: ConstantMap([0.5]), 1.2: ConstantMap([0.6])})
    assert only_sampled.map_for(0.0) is only_sampled.maps[0.7]
    only_greedy = Calibration({0.0: ConstantMap([0.5])})
    assert only_greedy.map_for(1.0) is only_greedy.maps[0.0]


def corrupt(path, mutate) -> None:
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("mutate, pattern", [
    (lambda d: d.pop("maps"), "field 'maps'"),
    (lambda d: d.pop("drafter"), "field 'drafter'"),
    (lambda d: d.update(format="something-else"), "field 'format'"),
    (lambda d: d.update(version=2), "field 'version'"),
    (lambda d: d["maps"]["0.0"].pop("temperatures"), r"maps\.0\.0\.temperatures"),
    (lambda d: d["maps"]["0.0"].update(temperatures=[1.0, -2.0]), r"maps\.0\.0.*positive"),
    (lambda d: d["maps"]["0.6"].update(weights=[[1.0, 2.0]]), r"maps\.0\.6\.weights\[0\]"),
    (lambda d: d["maps"]["1.0"].update(kind="spline"), r"maps\.1\.0\.kind"),
    (lambda d: d["maps"].update({"hot": d["maps"]["1.0"]}), "'hot'"),
])
def test_malformed_calibration_files_name_the_file_and_field(tmp_path, mutate, pattern) -> None:
    path = make_calibration().to_json(tmp_path / "cal.json")
    corrupt(path, mutate)
    with pytest.raises(ValueError, match=pattern) as err:
        Calibration.load(path)
    assert str(path) in str(err.value)


def test_truncated_garbage_and_missing_calibration_files_fail(tmp_path) -> None:
    path = make_calibration().to_json(tmp_path / "cal.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not valid JSON") as err:
        Calibration.load(path)
    assert str(path) in str(err.value)
    path.write_bytes(b"\xff\xfe\x00garbage\x81")
    with pytest.raises(ValueError, match="cal.json"):
        Calibration.load(path)
    with pytest.raises(ValueError, match="does not exist") as err:
        Calibration.load(tmp_path / "nowhere.json")
    assert "nowhere.json" in str(err.value)


def test_calibration_for_another_drafter_or_target_fails(tmp_path) -> None:
    cal = make_calibration()
    path = cal.to_json(tmp_path / "cal.json")
    with pytest.raises(ValueError, match="drafter") as err:
        Calibration.load(path, expect_drafter="eagle3-llama")
    assert "'dspark-qwen3-0.6b'" in str(err.value) and "'eagle3-llama'" in str(err.value)
    with pytest.raises(ValueError, match="target") as err:
        Calibration.load(path, expect_drafter=cal.drafter, expect_target="Qwen/Qwen3-8B@def")
    assert "'Qwen/Qwen3-0.6B@abc123'" in str(err.value) and "'Qwen/Qwen3-8B@def'" in str(err.value)


def test_map_from_dict_round_trips_every_kind() -> None:
    for m in make_calibration().maps.values():
        again = map_from_dict(m.to_dict())
        assert type(again) is type(m) and again.params() == m.params()


def test_round_records_save_and_load(tmp_path) -> None:
    records = head_records(n=100)
    path = records.save(tmp_path / "rounds.safetensors")
    loaded = RoundRecords.load(path)
    assert torch.equal(loaded.signals.nan_to_num(-9), records.signals.nan_to_num(-9))
    assert torch.equal(loaded.accepted, records.accepted) and loaded.domain == records.domain
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="rounds.safetensors"):
        RoundRecords.load(path)


def test_round_records_keep_prompt_ids_through_save_subset_and_concat(tmp_path) -> None:
    records = head_records(n=12)
    records.prompt = torch.arange(12) // 3  # four prompts of three rounds each
    records.domain = ["code"] * 6 + ["chat"] * 6  # prompt 1 spans both domains: two clusters
    loaded = RoundRecords.load(records.save(tmp_path / "r.safetensors"))
    assert torch.equal(loaded.prompt, records.prompt)
    sub = loaded.subset(loaded.prompt != 1)
    assert sub.prompt.tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3]
    both = RoundRecords.concat([sub, head_records(n=2)])
    assert both.prompt.tolist()[-2:] == [-1, -1]  # rounds of unknown prompts
    # a cluster is a (domain, prompt) pair; every unknown-prompt round is its own cluster
    c = both.clusters().tolist()
    assert len(set(c)) == len({(d, p) for d, p in zip(sub.domain, sub.prompt.tolist())}) + 2
    assert c[0] == c[1] == c[2] != c[3] and c[3] == c[4] == c[5] != c[6]


def test_round_records_files_without_prompt_ids_still_load(tmp_path) -> None:
    from safetensors.torch import load, save

    records = head_records(n=5)
    path = records.save(tmp_path / "old.safetensors")
    raw = path.read_bytes()
    meta = json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    tensors = {k: v for k, v in load(raw).items() if k != "prompt"}  # written before prompt ids existed
    path.write_bytes(save(tensors, metadata=meta))
    assert RoundRecords.load(path).prompt.tolist() == [-1] * 5


def _clustered(n_prompts: int, per_prompt: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Predictions that are right on average but wrong per prompt: each prompt shifts its rows' truth."""
    pred = 0.2 + 0.6 * torch.rand(n_prompts * per_prompt, generator=gen, dtype=torch.float64)
    shift = (torch.rand(n_prompts, generator=gen, dtype=torch.float64) - 0.5) * 0.4
    clusters = torch.arange(n_prompts).repeat_interleave(per_prompt)
    truth = (pred + shift[clusters]).clamp(0, 1)
    label = (torch.rand(pred.shape, generator=gen, dtype=torch.float64) < truth).double()
    return pred, label, clusters


def test_ece_standard_error_resamples_whole_prompts() -> None:
    gen = torch.Generator().manual_seed(0)
    pred, label, clusters = _clustered(40, 200, gen)
    se = ece_std_error(pred, label, clusters)
    se_rows = ece_std_error(pred, label, torch.arange(pred.numel()))  # every row its own cluster
    # how much does the ECE of a fresh draw of 40 prompts from the same world differ? The per-prompt
    # bootstrap knows it; taking rows as independent gives about half of it
    fresh = torch.tensor([ece(*_clustered(40, 200, gen)[:2]) for _ in range(40)])
    assert 0.7 * float(fresh.std()) < se < 1.5 * float(fresh.std())
    assert se_rows < 0.7 * float(fresh.std())
    assert ece_std_error([0.5, 0.5], [1.0, 1.0], [0, 0]) == 0.0
    assert math.isnan(ece_std_error([], [], []))
    with pytest.raises(ValueError, match="clusters"):
        ece_std_error([0.5, 0.5], [1.0, 0.0], [0])


def test_calibration_report_gives_a_prompt_standard_error_per_domain() -> None:
    records = head_records(n=3000)
    records.prompt = torch.arange(3000) // 30
    report = calibration_report(records, HeadTemperatureMap([2.0, 1.0, 1.0, 2.0]))
    for name in ("all", "chat", "code"):
        assert 0 < report["ece_se"][name] < 0.05
    assert report["ece_se"]["code"] > report["ece_se"]["all"]  # a third of the rounds
    assert "ECE standard error (prompts resampled)" in format_report_table(report, report)


def test_calibrating_without_greedy_peaks_gives_greedy_rows_a_prior(tmp_path) -> None:
    """`--ignore-greedy-peaks`: the fit sees greedy rows without their peak, so a map without a head reads no q
    for them (the engine then computes no peaks), while the recorded rounds keep the peaks."""
    records = joint_records()
    records.signals[..., 0] = NAN  # a drafter without a head: the peak is all a greedy row has
    blind = records.without_greedy_peaks()
    assert bool(torch.isnan(blind.signals[..., 1]).all()) and not bool(torch.isnan(records.signals[..., 1]).all())
    assert fit_map(records, has_head=False).reads_q and not fit_map(blind, has_head=False).reads_q
    from dspark.calibration.job import fit_and_score

    run = fit_and_score(records, joint_records(seed=5), 0.0, greedy_peaks=False)
    assert not run.fitted.reads_q and len(set(run.fitted.base.prior)) > 1  # one prior per position


def test_binned_map_reads_each_position_bin_and_keeps_the_running_minimum() -> None:
    """BinnedMap's vectorised lookup equals its definition: a_k = min(a_{k−1}, v_k[bin_k(â_k)]), bins closed on
    the right edge's left (x equal to an edge goes up), rows of unequal edge counts, positions past the fitted
    ones reading the last row, float32 and float64 alike, and the tables cached across calls."""
    base = HeadTemperatureMap([1.0, 0.8, 1.3])
    edges = [[0.2, 0.5, 0.8], [0.5], [0.3, 0.6]]
    values = [[0.1, 0.4, 0.7, 0.95], [0.3, 0.9], [0.2, 0.5, 0.85]]
    binned = BinnedMap(base, edges, values)
    gen = torch.Generator().manual_seed(3)
    for dtype, gamma in itertools.product((torch.float32, torch.float64), (1, 3, 5)):
        signals = torch.full((64, gamma, 3), float("nan"), dtype=dtype)
        signals[..., 0] = torch.randn(64, gamma, generator=gen, dtype=dtype) * 3
        signals[0, 0, 0] = 0.0  # â_1 = sigmoid(0) = 0.5: exactly on an edge of position 1
        got = binned.cumulative(signals)
        hat = torch.cumprod(base.conditional(signals), dim=1)
        want = torch.empty_like(hat)
        for r in range(64):
            prev = 1.0
            for k in range(gamma):
                j = min(k, len(values) - 1)
                x = float(hat[r, k])
                prev = min(prev, values[j][sum(x >= e for e in edges[j])])
                want[r, k] = prev
        assert got.dtype == dtype and torch.equal(got, want), (dtype, gamma)
        assert float(got[0, 0]) == pytest.approx(0.7)  # on the edge 0.5: the bin above it
    assert binned.cumulative(torch.zeros(2, 0, 3)).shape == (2, 0)
    assert set(binned._table_cache) == {(g, d, torch.device("cpu")) for g in (1, 3, 5)
                                        for d in (torch.float32, torch.float64)}


def test_calibration_reads_q_when_any_map_does() -> None:
    head = HeadTemperatureMap([1.0, 1.0])
    logistic = LogisticMap([0.5, 0.5], [[0.0, 1.0, 0.0]] * 2)
    assert not Calibration({0.0: head, 1.0: BinnedMap(head, [[0.5], []], [[0.3, 0.8], [0.6]])}).reads_q
    assert Calibration({0.0: head, 1.0: logistic}).reads_q  # a sampled map that reads q
    assert Calibration({0.0: head}, workload_maps={"code": {1.0: BinnedMap(logistic, [[]], [[0.5]])}}).reads_q
