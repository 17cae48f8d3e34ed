"""benchmarks/interleaved_arms.py: every arm serves the same blocks to completion, and the report's interval."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dspark.api import encode_prompt
from dspark.scheduling import uniform_cost_model

_spec = importlib.util.spec_from_file_location(
    "interleaved_arms", Path(__file__).resolve().parent.parent / "benchmarks" / "interleaved_arms.py")
interleaved_arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(interleaved_arms)


def test_arms_serve_the_same_block_to_completion_at_their_concurrency() -> None:
    arms = [interleaved_arms.Arm(spec, "dspark", 2, 0.0, 6, None, online,
                                 uniform_cost_model(gamma=7, batches=(1, 2), layout="padded"), ignore_eos=True)
            for spec, online in (("dspark", True), ("fixed:3", False), ("dspark+offline", True))]
    assert arms[0].engine.online_calibration is not None and arms[2].engine.online_calibration is None
    prompts = [encode_prompt(arms[0].target, p) for p in ("def add(a, b):", "The sea is", "1 + 1 =")]
    block = [(prompts[i], i) for i in range(3)]
    widths = []
    for arm in arms:
        arm.engine.on_step = lambda info, w=widths: w.append(info.batch)  # serve chains its own recording
        tokens, seconds = arm.serve(block)
        assert tokens == 3 * 6 and seconds > 0  # every request of the block, max_tokens each (EOS ignored)
        assert not arm.engine.has_work
        most = 3 if arm.spec == "fixed:3" else 7  # drafts a round verifies at most
        acc = arm.accounting()
        assert 0 <= acc["per_drafted_round"] <= most
        assert acc["rounds"] == len(arm.steps) > 0 and 0 < acc["drafted"] <= 1 and acc["round_ms"] > 0
        assert 0 < acc["verified_per_row"] <= most and acc["accepted_per_row"] <= acc["verified_per_row"]
        assert (acc["planned"] == 0) == (arm.spec == "fixed:3")  # only an adaptive arm plans
        assert 0 < acc["draft_ms"] + acc["schedule_ms"] + acc["target_ms"] <= acc["round_ms"]
        assert 1 <= acc["draft_width"] <= most if arm.spec == "fixed:3" else 1 <= acc["draft_width"] <= 7
    assert max(widths) == 2  # the closed loop keeps two running, never more
    with pytest.raises(ValueError, match=r"\+online or \+offline"):
        interleaved_arms.Arm("dspark+fast", "dspark", 1, 0.0, 4, None, False)


def test_t_quantiles() -> None:
    assert interleaved_arms.t95(1) == 12.71 and interleaved_arms.t95(11) == 2.23 and interleaved_arms.t95(100) == 1.96


def test_length_spread_gives_every_arm_the_same_seeded_lengths() -> None:
    arms = [interleaved_arms.Arm(spec, "dspark", 2, 0.0, 8, None, False,
                                 uniform_cost_model(gamma=7, batches=(1, 2), layout="padded"), length_spread=0.5,
                                 ignore_eos=True)
            for spec in ("dspark", "none")]
    prompts = [encode_prompt(arms[0].target, p) for p in ("def add(a, b):", "The sea is", "1 + 1 =", "Once")]
    block = [(prompts[i], 10 + i) for i in range(4)]
    lengths = [interleaved_arms.request_length(arms[0].lengths, seed) for _, seed in block]
    assert all(4 <= n <= 12 for n in lengths) and len(set(lengths)) > 1  # drawn in [0.5, 1.5] x 8, not all equal
    for arm in arms:
        tokens, _ = arm.serve(block)
        assert tokens == sum(lengths)


def test_blocks_take_prompts_in_turn_and_a_seed_offset_draws_another_sample() -> None:
    prompts = [[1], [2], [3]]
    blocks = interleaved_arms.make_blocks(prompts, 2, 2)
    assert blocks == [[([1], 0), ([2], 1)], [([3], 2), ([1], 3)]]
    shifted = interleaved_arms.make_blocks(prompts, 2, 2, seed_offset=1000)
    assert [p for b in shifted for p, _ in b] == [p for b in blocks for p, _ in b]  # the same prompts
    assert [s for b in shifted for _, s in b] == [1000, 1001, 1002, 1003]  # other seeds


def test_requests_end_at_eos_unless_told_to_ignore_it() -> None:
    cost = uniform_cost_model(gamma=7, batches=(1,), layout="padded")
    ends, ignores = (interleaved_arms.Arm("fixed:7", "dspark", 1, 0.0, 80, None, False, cost, ignore_eos=flag)
                     for flag in (False, True))
    prompt = encode_prompt(ends.target, "What is 2 + 2?")  # the bundled target answers in about 50 tokens
    tokens, _ = ends.serve([(prompt, 0)])
    assert 1 <= tokens < 80  # ended at the target's EOS, as a user's request does
    assert ignores.serve([(prompt, 0)])[0] == 80  # --ignore-eos: the whole length, past EOS


def test_a_report_is_written_with_its_json_beside_it(tmp_path) -> None:
    path = tmp_path / "runs" / "c4.txt"
    interleaved_arms.write_report(path, "line one\nline two", {"rates": {"dspark": [1.5]}})
    assert path.read_text() == "line one\nline two\n"
    assert json.loads(path.with_suffix(".json").read_text()) == {"rates": {"dspark": [1.5]}}
