"""Per-workload offline calibration: maps per workload label, their file format, the ECE noise floor, the
per-domain fit of `dspark calibrate`, and that decoding and the online calibrator use a request's workload."""
from __future__ import annotations

import json

import pytest
import torch

from dspark.calibration.job import fit_and_score
from dspark.calibration.maps import Calibration, ConstantMap, HeadTemperatureMap, fill_unavailable
from dspark.calibration.metrics import calibration_report, ece_noise_floor, format_report_table
from dspark.calibration.online import OnlineCalibrator
from dspark.calibration.records import RoundRecords
from tests.test_calibration import chain_accepted, random_available

NAN = float("nan")


def two_domain_records(n: int = 12000, seed: int = 0) -> RoundRecords:
    """Head logits that are logit(p)·T with T = 0.5 on "code" (an under-confident head)
    and T = 3 on "math": no single temperature per position calibrates both domains."""
    gen = torch.Generator().manual_seed(seed)
    gamma = 4
    z = torch.randn(n, gamma, generator=gen, dtype=torch.float64) * 1.5 + 1.0
    available = random_available(n, gamma, gen)
    accepted = chain_accepted(torch.sigmoid(z), available, gen)
    domains = ["code" if i % 2 else "math" for i in range(n)]
    scale = torch.tensor([0.5 if d == "code" else 3.0 for d in domains], dtype=torch.float64).view(-1, 1)
    signals = torch.full((n, gamma, 3), NAN)
    signals[..., 0] = (z * scale).float()
    return RoundRecords(signals, available, accepted, torch.ones(n, dtype=torch.bool), domains)


def test_workload_maps_round_trip_and_choose_rows_maps(tmp_path) -> None:
    cal = Calibration({0.0: ConstantMap([0.6, 0.5]), 1.0: ConstantMap([0.7, 0.4])}, drafter="d", target="t",
                      workload_maps={"math": {0.0: ConstantMap([0.9, 0.8]), 1.0: ConstantMap([0.3, 0.2])},
                                     "code": {1.0: ConstantMap([0.55])}})
    loaded = Calibration.load(cal.to_json(tmp_path / "cal.json"), "d", "t")
    assert loaded.workloads == ["math", "code"]
    assert json.loads((tmp_path / "cal.json").read_text())["workloads"]["math"]["1.0"]["values"] == [0.3, 0.2]
    signals, available = torch.zeros(6, 2, 3), torch.full((6,), 2)
    temps = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    names = ["math", "math", "code", "code", None, "unknown"]
    out = loaded.survival(signals, available, temps, names)
    expected = [[0.9, 0.72], [0.3, 0.06],
                [0.6, 0.3],    # code has no greedy map: the pooled greedy map, never its T 1 map
                [0.55, 0.55 ** 2], [0.7, 0.28], [0.6, 0.3]]
    assert torch.allclose(out.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert torch.equal(loaded.survival(signals, available, temps), cal.survival(signals, available, temps, None))
    assert loaded.map_for(0.0, "code") is loaded.maps[0.0]
    assert loaded.map_for(0.9, "code") is loaded.workload_maps["code"][1.0]


@pytest.mark.parametrize("workloads, pattern", [
    ([], "field 'workloads' must be an object"),
    ({"math": {}}, "field 'workloads.math' must be a non-empty object"),
    ({"math": {"hot": {"kind": "constant", "values": [0.5]}}}, "field 'workloads.math' has key 'hot'"),
    ({"math": {"1.0": {"kind": "constant"}}}, r"field 'workloads.math.1.0.values' is missing"),
    ({"": {"1.0": {"kind": "constant", "values": [0.5]}}}, "empty workload label"),
])
def test_malformed_workload_maps_name_the_field(tmp_path, workloads, pattern) -> None:
    path = Calibration({1.0: ConstantMap([0.5])}, "d", "t").to_json(tmp_path / "cal.json")
    data = json.loads(path.read_text())
    data["workloads"] = workloads
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=pattern):
        Calibration.load(path)


def test_noise_floor_matches_a_perfectly_calibrated_predictor_and_not_a_wrong_one() -> None:
    gen = torch.Generator().manual_seed(3)
    n, gamma = 3000, 5
    cond = torch.rand(n, gamma, generator=gen, dtype=torch.float64) * 0.6 + 0.35
    available = random_available(n, gamma, gen)
    rows = torch.ones(n, dtype=torch.bool)
    floor = ece_noise_floor(cond, available, rows, draws=40)
    assert 0.002 < floor < 0.03  # sampling noise of ~9k pooled rows in 20 bins
    records_ok = RoundRecords(torch.logit(cond).float().unsqueeze(-1).expand(n, gamma, 3).clone(), available,
                              chain_accepted(cond, available, gen), torch.ones(n, dtype=torch.bool))
    head = HeadTemperatureMap([1.0] * gamma)
    ok = calibration_report(records_ok, head)
    assert ok["ece_floor"]["all"] == pytest.approx(floor, rel=0.15)  # other draws, float32 logits
    assert ok["headline_ece"]["all"] < 3 * floor  # calibrated: within noise
    wrong = RoundRecords(records_ok.signals, available, chain_accepted(cond * 0.8, available, gen),
                         records_ok.greedy)
    assert calibration_report(wrong, head)["headline_ece"]["all"] > 5 * floor


def test_per_domain_fit_calibrates_domains_one_temperature_cannot() -> None:
    fit, held = two_domain_records(seed=0), two_domain_records(seed=1)
    run = fit_and_score(fit, held, 1.0, label="synthetic", method="sts")
    assert set(run.workload_maps) == {"code", "math"}
    assert run.workload_maps["code"].temperatures[0] == pytest.approx(0.5, rel=0.15)
    assert run.workload_maps["math"].temperatures[0] == pytest.approx(3.0, rel=0.15)
    for domain in ("code", "math"):
        pooled, own = run.after["headline_ece"][domain], run.after_workload["headline_ece"][domain]
        assert own < 0.5 * pooled
        assert own < 3 * run.after_workload["ece_floor"][domain]
    table = format_report_table(run.before, run.after, run.after_workload)
    assert "| metric | before | after | after, per workload |" in table and "noise floor" in table
    single = fit_and_score(fit.subset([d == "code" for d in fit.domain]), held, 1.0)
    assert single.workload_maps == {} and single.after_workload is None  # one domain: nothing to split


def test_the_report_scores_the_fit_with_the_halves_swapped_too() -> None:
    """The swapped direction is the same procedure fitted on the held-out rounds and scored on the fitting
    rounds: equal to fitting and scoring by hand, and calibrated on this world in both directions."""
    from dspark.calibration.fit import fit_map
    from dspark.calibration.job import format_swapped

    fit, held = two_domain_records(seed=0), two_domain_records(seed=1)
    run = fit_and_score(fit, held, 1.0, label="synthetic", method="sts")
    maps = {d: fit_map(held.subset([x == d for x in held.domain]), True, "sts") for d in ("code", "math")}
    by_hand = calibration_report(fit, fit_map(held, True, "sts"), maps)
    assert run.swapped["rounds"] == len(fit)
    for domain in ("all", "code", "math"):
        assert run.swapped["ece"][domain] == pytest.approx(by_hand["headline_ece"][domain])
        assert run.swapped["ece"][domain] < 3 * by_hand["ece_floor"][domain]
    text = format_swapped(run)
    assert "halves swapped" in text and "code:" in text and "mean" in text


def test_online_calibrator_uses_a_workloads_offline_map_as_its_prior() -> None:
    pooled, math_map = ConstantMap([0.5, 0.5]), ConstantMap([0.9, 0.9])
    cal = Calibration({1.0: pooled}, workload_maps={"math": {1.0: math_map}})
    online = OnlineCalibrator(cal, gamma=2, refit_every=5, min_rounds=5, max_request_share=1.0,
                              workloads=["code"])
    signals, available = torch.zeros(2, 2, 3), torch.full((2,), 2)
    before = online.survival(signals, available, [1.0, 1.0], ["math", "code"])
    assert torch.allclose(before.double(), torch.tensor([[0.9, 0.81], [0.5, 0.25]], dtype=torch.float64))
    for i in range(60):  # unlabelled traffic that always rejects: the default correction becomes pessimistic
        assert online.observe(torch.zeros(2, 3), 2, 0, False, None, request_id=i, temperature=1.0)
    after = online.survival(signals, available, [1.0, 1.0], ["math", "code"])
    assert after[1, 0] < 0.4  # code has no offline map of its own: it is served the default correction
    assert torch.allclose(after[0].double(), torch.tensor([0.9, 0.81], dtype=torch.float64))  # math keeps its own
    for i in range(60):  # math's own rounds, all accepted: its correction is fitted on its own prior logits
        assert online.observe(torch.zeros(2, 3), 2, 2, False, "math", request_id=100 + i, temperature=1.0)
    assert online.parameters("math")["sampled"]["source"] == "own"
    assert online.survival(signals[:1], available[:1], [1.0], ["math"])[0, 0] > 0.9


def test_decode_uses_each_requests_workload_calibration() -> None:
    from dspark.api import load_target
    from dspark.decoding import decode
    from dspark.drafters.ngram import NgramDrafter

    target = load_target()
    drafter = NgramDrafter(gamma=4)
    drafter.calibration = Calibration({0.0: ConstantMap([0.99] * 4)},
                                      workload_maps={"hopeless": {0.0: ConstantMap([0.01] * 4)}})
    prompt = target.tokenizer("one two three one two three one two three one two", add_special_tokens=False)
    prompts = [prompt["input_ids"]] * 2
    out = decode(target, drafter, prompts, max_new_tokens=24, scheduler="threshold:0.5",
                 workloads=[None, "hopeless"])
    assert out[0].token_ids == out[1].token_ids  # lossless either way
    assert sum(r.draft_len for r in out[0].rounds) > 0
    assert all(r.draft_len == 0 for r in out[1].rounds)  # its workload's map never clears the threshold
    with pytest.raises(ValueError, match="2 workload labels for 1 prompts"):
        decode(target, drafter, prompts[:1], max_new_tokens=4, workloads=[None, "x"])


# ---------------------------------------------------------------- histogram binning


def uninformative_middle_records(n: int = 20000, seed: int = 0) -> RoundRecords:
    """A head whose logit is informative only at the extremes: rows with |logit| < 1 survive with
    probability 0.3 whatever the logit says, a pattern no temperature can fix."""
    gen = torch.Generator().manual_seed(seed)
    gamma = 3
    z = torch.randn(n, gamma, generator=gen, dtype=torch.float64) * 2.0
    p = torch.where(z.abs() < 1, torch.full_like(z, 0.3), torch.sigmoid(z))
    available = random_available(n, gamma, gen)
    accepted = chain_accepted(p, available, gen)
    signals = torch.full((n, gamma, 3), NAN)
    signals[..., 0] = z.float()
    return RoundRecords(signals, available, accepted, torch.ones(n, dtype=torch.bool))


def test_binned_map_round_trips_keeps_survival_non_increasing_and_reads_its_base() -> None:
    from dspark.calibration.maps import BinnedMap, map_from_dict

    m = BinnedMap(HeadTemperatureMap([1.0, 2.0]), edges=[[0.3, 0.6], [0.5]], values=[[0.9, 0.2, 0.7], [0.1, 0.95]])
    assert m.reads_head and map_from_dict(json.loads(json.dumps(m.to_dict()))).to_dict() == m.to_dict()
    signals = torch.randn(50, 4, 3)
    available = torch.randint(0, 5, (50,))
    signals[torch.arange(4).view(1, -1) >= available.view(-1, 1)] = NAN  # padding past available is allowed
    a = m.survival(signals, available)
    assert bool((a[:, 1:] <= a[:, :-1] + 1e-7).all())  # a prefix order per row
    assert bool((a[torch.arange(4).view(1, -1) >= available.view(-1, 1)] == 0).all())
    base = torch.cumprod(torch.sigmoid(torch.nan_to_num(signals[..., 0]) / torch.tensor([1.0, 2.0, 2.0, 2.0])), 1)
    row = int(torch.nonzero(available == 4)[0])
    first = {0: 0.9, 1: 0.2, 2: 0.7}[int(torch.bucketize(base[row, 0], torch.tensor([0.3, 0.6]), right=True))]
    assert float(a[row, 0]) == pytest.approx(first, abs=1e-6)
    with pytest.raises(ValueError, match="edges must be finite and increasing"):
        BinnedMap(HeadTemperatureMap([1.0]), edges=[[0.6, 0.3]], values=[[0.1, 0.2, 0.3]])
    with pytest.raises(ValueError, match="bin values must lie in"):
        BinnedMap(HeadTemperatureMap([1.0]), edges=[[]], values=[[1.0]])
    with pytest.raises(ValueError, match=r"field 'map.base.kind'"):
        map_from_dict({"kind": "binned", "base": {"kind": "nope"}, "edges": [[]], "values": [[0.5]]})


def test_monotone_cells_is_the_weighted_projection_onto_both_orders() -> None:
    """x = monotone_cells(y, w) is feasible (rises along bins, falls along positions) and is the weighted
    least-squares projection: Σ w (y − x)(z − x) ≤ 0 for every feasible z (the variational inequality that
    characterises the projection onto a convex set), so no feasible z is closer to y."""
    from dspark.calibration.fit import monotone_cells

    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        y = torch.rand(5, 8, generator=gen, dtype=torch.float64)
        w = torch.rand(5, 8, generator=gen, dtype=torch.float64) * 50 + 0.1
        x = monotone_cells(y, w)
        assert bool((x[:, 1:] >= x[:, :-1]).all()) and bool((x[1:] <= x[:-1]).all())
        for _ in range(200):
            z = torch.rand(5, 8, generator=gen, dtype=torch.float64)
            z = torch.cummin(torch.cummax(z, dim=1).values, dim=0).values  # a random feasible matrix
            assert float((w * (y - x) * (z - x)).sum()) <= 1e-6
        assert float((w * (y - x) ** 2).sum()) <= float((w * (y - z) ** 2).sum()) + 1e-9
    feasible = torch.cummin(torch.cummax(torch.rand(4, 6, generator=gen, dtype=torch.float64), 1).values, 0).values
    assert torch.allclose(monotone_cells(feasible, torch.ones(4, 6, dtype=torch.float64)), feasible, atol=1e-9)


def test_fitted_bins_fall_along_the_block_so_the_cap_changes_nothing() -> None:
    """Shared edges, cells rising with the bin and falling with the position: each row's bin values already
    fall along its block (â_k ≤ â_{k−1}), so `BinnedMap`'s cap a_k = min(a_{k−1}, ·) never binds."""
    from dspark.calibration.fit import fit_binned, fit_sequential_temperature

    fit = uninformative_middle_records(seed=0)
    binned = fit_binned(fit, fit_sequential_temperature(fit))
    assert all(e == binned.edges[0] for e in binned.edges) and len(binned.edges[0]) >= 10
    v = torch.tensor(binned.values, dtype=torch.float64)
    assert bool((v[:, 1:] >= v[:, :-1]).all()) and bool((v[1:] <= v[:-1]).all())
    held = uninformative_middle_records(n=3000, seed=5)
    signals = fill_unavailable(held.signals, held.available)
    base = torch.cumprod(binned.base.conditional(signals).to(torch.float64), dim=1)
    edges = torch.tensor(binned.edges[0], dtype=torch.float64)
    raw = torch.stack([v[k][torch.bucketize(base[:, k].contiguous(), edges, right=True)]
                       for k in range(base.shape[1])], dim=1)
    assert torch.allclose(binned.cumulative(signals.to(torch.float64)), raw)  # the cap is a no-op
    in_sample = calibration_report(fit, binned)
    assert in_sample["headline_ece"]["all"] < in_sample["ece_floor"]["all"]  # no cap pulling values down


def test_binning_calibrates_a_head_no_temperature_can() -> None:
    from dspark.calibration.fit import fit_binned, fit_map, fit_sequential_temperature

    fit, held = uninformative_middle_records(seed=0), uninformative_middle_records(seed=1)
    sts = fit_sequential_temperature(fit)
    binned = fit_binned(fit, sts)
    assert fit_map(fit, True).to_dict() == binned.to_dict() and fit_map(fit, True, "sts").to_dict() == sts.to_dict()
    r_sts, r_bin = calibration_report(held, sts), calibration_report(held, binned)
    assert r_sts["headline_ece"]["all"] > 0.03
    assert r_bin["headline_ece"]["all"] < 0.5 * r_sts["headline_ece"]["all"]
    assert r_bin["headline_ece"]["all"] < 3 * r_bin["ece_floor"]["all"]
    assert r_bin["domains"]["all"]["cumulative"]["pooled"]["brier"] < r_sts["domains"]["all"]["cumulative"]["pooled"]["brier"]
    with pytest.raises(ValueError, match="unknown calibration method 'isotonic'"):
        fit_map(fit, True, "isotonic")
