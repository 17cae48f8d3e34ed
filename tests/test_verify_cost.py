"""benchmarks/verify_cost.py: times verification and the finiteness check on a synthetic block."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "verify_cost", Path(__file__).resolve().parent.parent / "benchmarks" / "verify_cost.py")
verify_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verify_cost)


@pytest.mark.parametrize("temperature, dtype, greedy", [("1", "bfloat16", "0"), ("0", "bfloat16", "0"),
                                                       ("1", "float32", "2")])
def test_it_reports_both_times_for_the_block_it_was_given(temperature, dtype, greedy, capsys):
    assert verify_cost.main(["--rows", "3", "--drafts", "2", "--vocab", "64", "--temperature", temperature,
                             "--repeats", "3", "--logits-dtype", dtype, "--greedy-rows", greedy]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"3 rows ({greedy} greedy), 2 drafts, vocabulary 64, temperature {temperature}, "
                           f"{dtype} logits, one thread: verify ")
    times = [float(part.split()[-2]) for part in line.split(": ", 1)[1].split(" (")[0].split(", ")]
    assert len(times) == 2 and all(t > 0 for t in times)
