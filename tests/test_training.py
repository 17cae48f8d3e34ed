"""Drafter training: anchored blocks and masks, losses, exact resume, DDP equals single-process."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters.block import BlockDrafter
from dspark.target import CausalLM
from dspark.training.block_objective import block_drafter_loss, target_pass
from dspark.training.blocks import build_blocks, sample_anchors
from dspark.training.losses import DFLASH_WEIGHTS, LossWeights, drafter_loss, position_weights
from dspark.training.trainer import train
from tests.training_fixtures import tiny_setup

ROOT = Path(__file__).resolve().parent.parent


def test_anchors_are_the_tokens_before_answer_tokens():
    """Every position whose next token is an answer token, the last header token before each answer included:
    a drafter never trained on that anchor rejects every request's first round at inference."""
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1])
    anchors = sample_anchors(mask, 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [2, 3, 4, 5, 7, 8]
    assert len(sample_anchors(mask, 2, torch.Generator().manual_seed(0))) == 2


def test_block_mask_labels_and_validity():
    ids = torch.arange(10, 22)  # S = 12
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    b = build_blocks(ids, mask, torch.tensor([2, 8]), block_size=4, mask_token_id=99)
    assert b.input_ids.tolist() == [12, 99, 99, 99, 18, 99, 99, 99]
    assert b.positions.tolist() == [2, 3, 4, 5, 8, 9, 10, 11]
    assert b.labels[0].tolist() == [13, 14, 15, 16]
    assert b.valid[1].tolist() == [True, True, True, False]  # label 12 is past the sequence
    assert b.prev_ids[0].tolist() == [12, 13, 14, 15]  # teacher-forced previous tokens
    # block 0 sees context 0..1 and its own 4 slots; block 1 sees context 0..7 and its own slots
    assert b.mask[0, :12].tolist() == [True] * 2 + [False] * 10
    assert b.mask[5, :12].tolist() == [True] * 8 + [False] * 4
    assert b.mask[0, 12:].tolist() == [True] * 4 + [False] * 4
    assert b.mask[6, 12:].tolist() == [False] * 4 + [True] * 4


def test_losses_weights_and_confidence_target():
    w = position_weights(torch.ones(1, 7, dtype=torch.bool), 4.0)
    assert torch.allclose(w[0], torch.exp(-torch.arange(7) / 4.0))
    assert position_weights(torch.ones(1, 3, dtype=torch.bool), None).tolist() == [[1.0, 1.0, 1.0]]
    draft = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    target = torch.tensor([[[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]])
    valid = torch.tensor([[True, True]])
    labels = torch.tensor([[1, 0]])
    conf = torch.zeros(1, 2)
    total, stats = drafter_loss(draft, target, labels, valid, LossWeights(0.1, 0.9, 1.0, 4.0), conf)
    pd, pt = torch.softmax(draft[0, 0], -1), torch.softmax(target[0, 0], -1)
    l1 = (pd - pt).abs().sum()
    w = torch.tensor([1.0, math.exp(-0.25)])
    assert torch.allclose(stats["tv"], w[0] * l1 / w.sum())
    assert torch.allclose(stats["accept_rate"], torch.stack([1 - 0.5 * l1, torch.tensor(1.0)]))
    ce0 = -torch.log_softmax(draft[0, 0], -1)[1]
    ce1 = -torch.log_softmax(draft[0, 1], -1)[0]
    assert torch.allclose(stats["ce"], (w[0] * ce0 + w[1] * ce1) / w.sum())
    c_star = torch.stack([1 - 0.5 * l1, torch.tensor(1.0)])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf[0], c_star, reduction="none")
    assert torch.allclose(stats["conf"], (w * bce).sum() / w.sum())
    assert torch.allclose(total, 0.1 * stats["ce"] + 0.9 * stats["tv"] + stats["conf"])
    total, stats = drafter_loss(draft, target, labels, valid, DFLASH_WEIGHTS)
    assert torch.allclose(total, stats["ce"]) and "conf" not in stats
    # precomputed target probabilities give the same loss as the target logits
    a, _ = drafter_loss(draft, target, labels, valid, LossWeights(0.1, 0.9, 1.0, 4.0), conf)
    b, _ = drafter_loss(draft, None, labels, valid, LossWeights(0.1, 0.9, 1.0, 4.0), conf,
                        target_probs=torch.softmax(target, -1))
    assert torch.allclose(a, b)


def test_markov_block_bias_per_distinct_token_matches_per_slot():
    from dspark.drafters.heads import MarkovHead

    torch.manual_seed(0)
    head = MarkovHead(50, 8, 4)
    torch.nn.init.normal_(head.markov_w2.weight)
    prev = torch.tensor([[3, 7, 3, 9], [7, 7, 1, 3]])  # repeated tokens, as overlapping training blocks have
    fast = head.block_bias(torch.zeros(2, 4, 8), prev)
    slow = head.markov_w2(head.markov_w1(prev))
    assert fast.shape == (2, 4, 50) and torch.allclose(fast, slow)
    g = torch.randn_like(slow)
    grads = [torch.autograd.grad((out * g).sum(), [head.markov_w1.weight, head.markov_w2.weight])
             for out in (head.block_bias(torch.zeros(2, 4, 8), prev), head.markov_w2(head.markov_w1(prev)))]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(*grads))


def test_training_blocks_equal_inference_blocks():
    target, model, seqs, _ = tiny_setup()
    ids, mask = seqs[5]
    a = 14
    lm = CausalLM(target, feature_layers=model.cfg.target_layer_ids)
    lm.reset(1)
    pre = lm.forward([ids[:a].tolist()], features=True)
    drafter = BlockDrafter(model, lm)
    drafter.start([ids[: a + 1].tolist()], pre.features)
    h_inf = drafter.block_hidden([ids[: a + 1].tolist()])
    feats, _ = target_pass(target, ids, model.cfg.target_layer_ids)
    b = build_blocks(ids, mask, torch.tensor([9, a]), model.cfg.block_size, model.cfg.mask_token_id)
    ctx = model.context_kv(feats.unsqueeze(0), torch.arange(len(ids)).unsqueeze(0))
    with torch.no_grad():
        h = model(target.get_input_embeddings()(b.input_ids).unsqueeze(0), b.positions.unsqueeze(0), ctx, b.mask.unsqueeze(0))
    torch.testing.assert_close(h[0, 4:8], h_inf[0], atol=1e-5, rtol=1e-5)


def test_block_states_equal_with_and_without_context_padding():
    """A batch whose rows hold contexts of different lengths (padding masked) drafts what each row
    drafts alone, where the context has no padding and attention runs without a mask."""
    target, model, seqs, _ = tiny_setup()
    ids = seqs[5][0].tolist()
    prompts = [ids[:10], ids[:13]]
    lm = CausalLM(target, feature_layers=model.cfg.target_layer_ids)
    lm.reset(2)
    batch = BlockDrafter(model, lm)
    batch.start(prompts, lm.forward([p[:-1] for p in prompts], features=True).features)
    assert not batch.ctx.dense
    h_batch = batch.block_hidden(prompts)
    for r, p in enumerate(prompts):
        lm.reset(1)
        alone = BlockDrafter(model, lm)
        alone.start([p], lm.forward([p[:-1]], features=True).features)
        assert alone.ctx.dense
        torch.testing.assert_close(alone.block_hidden([p])[0], h_batch[r], atol=1e-5, rtol=1e-5)


def test_training_reduces_loss_and_resumes_exactly(tmp_path):
    target, model, seqs, cfg = tiny_setup()
    cfg.steps = 8
    train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "a", log_path=tmp_path / "a.jsonl")
    full = [json.loads(l) for l in open(tmp_path / "a.jsonl")]
    assert full[-1]["loss"] < full[0]["loss"]
    assert len(full[0]["accept_rate"]) == 4 and len(full[0]["conf_pred"]) == 4
    _, model_b, _, _ = tiny_setup()
    train(model_b, target, seqs, block_drafter_loss, cfg, tmp_path / "b", log_path=tmp_path / "b.jsonl", stop_after=3)
    killed_rows = [dict(full[i], loss=-1.0) for i in (3, 4)]  # a run killed after logging steps 4-5, before saving
    with open(tmp_path / "b.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in killed_rows)
    _, model_c, _, _ = tiny_setup()  # a new process rebuilds the model, then finds the saved state
    train(model_c, target, seqs, block_drafter_loss, cfg, tmp_path / "b", log_path=tmp_path / "b.jsonl")
    resumed_log = [json.loads(l) for l in open(tmp_path / "b.jsonl")]
    assert [r["step"] for r in resumed_log] == list(range(1, 9))  # the killed run's unsaved steps are redone, once
    assert [r["loss"] for r in resumed_log] == [r["loss"] for r in full]
    elapsed = [r["elapsed_s"] for r in resumed_log]  # training time counts every segment
    assert all(t1 > t0 for t0, t1 in zip(elapsed, elapsed[1:]))
    for p, q in zip(model.parameters(), model_c.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("features", ["on-the-fly", "cache"])
def test_ddp_two_processes_equal_single_process(tmp_path, features):
    target, model, seqs, cfg = tiny_setup()
    train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "single")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path), features]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    if features == "cache":
        assert len(list((tmp_path / "cache").glob("shard-*.safetensors"))) == 3
    ddp = load_file(str(tmp_path / "ddp.safetensors"))
    for name, p in model.state_dict().items():
        torch.testing.assert_close(ddp[name], p, atol=1e-5, rtol=1e-4)


def test_tensorboard_log_matches_the_jsonl_log_and_continues_after_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    target, model, seqs, cfg = tiny_setup()
    cfg.steps = 6
    board = tmp_path / "tb"
    train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "s", log_path=tmp_path / "log.jsonl",
          stop_after=3, tensorboard_dir=board)
    with SummaryWriter(str(board)) as killed:  # a run killed after logging steps 4-5, before saving
        for step in (4, 5):
            killed.add_scalar("train/loss", -1.0, step)
    _, model_b, _, _ = tiny_setup()
    train(model_b, target, seqs, block_drafter_loss, cfg, tmp_path / "s", log_path=tmp_path / "log.jsonl",
          tensorboard_dir=board)
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    acc = EventAccumulator(str(board))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 7))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in log], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/accept_rate/slot2")] == pytest.approx(
        [r["accept_rate"][1] for r in log], rel=1e-6)


def test_bf16_autocast_is_used_where_the_device_supports_it():
    from dspark.training.trainer import bf16_supported

    assert bf16_supported("cpu")
    if torch.cuda.is_available():
        assert bf16_supported("cuda") == (torch.cuda.get_device_capability()[0] >= 8)


def test_learning_rate_warm_up_then_cosine_to_zero():
    from dspark.training.trainer import TrainConfig, lr_at

    cfg = TrainConfig(steps=100, lr=1e-3, warmup_frac=0.1)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warm-up to the peak
    assert lrs[9] == pytest.approx(1e-3) and lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(5e-4)  # the cosine's midpoint: half the peak
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 1e-6  # decays to (nearly) zero
    assert lr_at(cfg.steps + 5, cfg) == pytest.approx(0.0, abs=1e-12)  # and stays there


def test_training_logs_the_schedule_and_clips_gradients(tmp_path, monkeypatch):
    """The optimiser sees the scheduled learning rate and gradients clipped to max_grad_norm at every step;
    the log records the scheduled rate and the norm before clipping."""
    from dspark.training.trainer import lr_at

    target, model, seqs, cfg = tiny_setup()
    cfg.steps, cfg.warmup_frac, cfg.max_grad_norm = 6, 0.34, 1e-3
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(opt, *args, **kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append((opt.param_groups[0]["lr"], torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.float()) for g in grads])).item()))
        return step(opt, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    train(model, target, seqs, block_drafter_loss, cfg, tmp_path / "out", log_path=tmp_path / "log.jsonl")
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [lr for lr, _ in seen] == pytest.approx([lr_at(s, cfg) for s in range(cfg.steps)])
    assert [r["lr"] for r in log] == pytest.approx([lr_at(s, cfg) for s in range(cfg.steps)])
    assert all(r["grad_norm"] > 10 * cfg.max_grad_norm for r in log)  # so clipping had work to do
    assert all(norm <= cfg.max_grad_norm * (1 + 1e-3) for _, norm in seen)
