"""`dspark train` killed with SIGKILL at several points, then resumed, ends bit for bit where an
uninterrupted run with the same seed ends: the same final weights and the same JSONL loss curve, once
single-process and once under torchrun with 2 processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark.zoo import default_target_path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "train_kill_worker.py"
TIMED = ("tokens_per_s", "elapsed_s")  # wall-clock fields of a log row; everything else must be equal
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny random target folder with the bundled tokenizer, regenerated-format training data)."""
    d = tmp_path_factory.mktemp("kill")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    Qwen3ForCausalLM(cfg).save_pretrained(d / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_target_path() / name, d / "target" / name)
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": torch.randint(4, 8000, (6,), generator=g).tolist(),
             "answer_ids": torch.randint(4, 8000, (18 + i,), generator=g).tolist()} for i in range(8)]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "target", d / "data.jsonl"


def command(setup: tuple[Path, Path], out: Path, fault: str = "none", nth: int = 0, ddp: bool = False) -> list[str]:
    """The worker running `dspark train dspark` on the tiny setup: 12 steps, a train state every 3."""
    target, data = setup
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if ddp
              else [sys.executable])
    return [*launch, str(WORKER), fault, str(nth), "train", "dspark", "--data", str(data), "--out", str(out),
            "--target", str(target), "--steps", "12", "--batch", "2", "--num-anchors", "4", "--block-size", "3",
            "--markov-rank", "8", "--intermediate-size", "32", "--ckpt-every", "3", "--no-bf16", "--seed", "3"]


def run(cmd: list[str], status: int = 0) -> None:
    """Run to the end, which must come with exit `status` (-9: killed by SIGKILL; 1: torchrun lost a worker)."""
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr[-3000:]


def logged_step(log: Path) -> int:
    """The last step of the log's complete rows (0 before the first)."""
    steps = [0]
    for line in log.read_text().splitlines(keepends=True) if log.exists() else []:
        if line.endswith("\n"):
            steps.append(json.loads(line)["step"])
    return steps[-1]


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, their children, and so on (torchrun's workers have their own sessions)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def kill_at_step(cmd: list[str], log: Path, step: int) -> None:
    """Start the run and SIGKILL it and every process it started once its log holds a row of `step` or later."""
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while logged_step(log) < step:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.005)
    for pid in [proc.pid, *descendants(proc.pid)]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def curve(out: Path) -> list[dict]:
    """The run's log rows without their wall-clock fields."""
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMED} for r in rows]


def assert_same_run(resumed: Path, reference: Path) -> None:
    """Final weights, last train state and loss curve equal bit for bit; no temporary file is left."""
    assert curve(resumed) == curve(reference)
    assert [r["step"] for r in curve(resumed)] == list(range(1, 13))
    for name in ("model.safetensors", "_train_state/train_state.safetensors"):
        got, want = load_file(str(resumed / name)), load_file(str(reference / name))
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"{name}: {key} differs"
    assert not [p.name for p in resumed.rglob("*.tmp")]


def test_killed_and_resumed_training_equals_an_uninterrupted_run(setup, tmp_path):
    run(command(setup, tmp_path / "ref"))
    out = tmp_path / "killed"
    log = out / "train_log.jsonl"
    kill_at_step(command(setup, out), log, 4)  # steps past the state of step 3 are logged, not saved
    with open(log, "a") as f:
        f.write('{"step": 99, "lr": 0.0')  # and a row half written when the kill came
    run(command(setup, out, "mid-state", 2), -signal.SIGKILL)  # resumes at 3; dies writing the state of step 9
    assert list((out / "_train_state").glob(".train_state.safetensors.*.tmp"))  # the torn temporary file
    assert json.loads((out / "_train_state" / "train_state.json").read_text())["step"] == 6
    run(command(setup, out, "before-json", 1), -signal.SIGKILL)  # resumes at 6; dies after step 9's tensors
    assert json.loads((out / "_train_state" / "train_state.json").read_text())["step"] == 6  # a stale copy
    run(command(setup, out))  # resumes at 9, from the tensors' own metadata
    assert_same_run(out, tmp_path / "ref")


def test_killed_and_resumed_ddp_training_equals_an_uninterrupted_ddp_run(setup, tmp_path):
    run(command(setup, tmp_path / "ref", ddp=True))
    out = tmp_path / "killed"
    kill_at_step(command(setup, out, ddp=True), out / "train_log.jsonl", 4)  # torchrun and both workers
    run(command(setup, out, "mid-state", 1, ddp=True), 1)  # rank 0 dies writing step 6's state
    assert list((out / "_train_state").glob(".train_state.safetensors.*.tmp"))
    assert json.loads((out / "_train_state" / "train_state.json").read_text())["step"] == 3
    run(command(setup, out, ddp=True))
    assert_same_run(out, tmp_path / "ref")
