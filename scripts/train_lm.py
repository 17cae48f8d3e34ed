"""Train a bundled causal LM (the target or the small draft model) from scratch on the corpus.

Conversations are rendered with the tokenizer's chat template, shuffled with the seed and packed into
fixed-length sequences. AdamW with warm-up and cosine decay, bf16 autocast on CPU, periodic safetensors
checkpoints that resume (model, optimizer moments, step, data position). At the end the model is saved
with `save_pretrained` and its card (README.md) records size, data, held-out loss per domain and command.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dspark.training.trainer import has_train_state, load_train_state, save_train_state

DOMAINS = ("code", "prose", "math")


def load_conversations(corpus: Path, split: str, domain: str) -> list[list[str]]:
    """Return the turns of every conversation of one domain and split."""
    with open(corpus / f"{domain}_{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["turns"] for line in f]


def render(tokenizer, turns: list[str]) -> tuple[list[int], list[int]]:
    """Return token ids of a user/assistant conversation and a mask that is 1 on assistant tokens."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}], add_generation_prompt=True, tokenize=False)
    full = prompt + turns[1] + "<|im_end|>\n"
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    return ids, [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))


def packed_stream(tokenizer, corpus: Path, seq_len: int, seed: int) -> torch.Tensor:
    """Tokenize all training conversations, shuffle them and pack into a [N, seq_len + 1] tensor."""
    convs = [c for d in DOMAINS for c in load_conversations(corpus, "train", d)]
    random.Random(seed).shuffle(convs)
    flat: list[int] = []
    for turns in tqdm(convs, desc="tokenize", mininterval=5):
        flat.extend(render(tokenizer, turns)[0])
    n = len(flat) // (seq_len + 1)
    return torch.tensor(flat[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


@torch.no_grad()
def heldout_loss(model, tokenizer, corpus: Path, limit: int = 200) -> dict[str, float]:
    """Mean cross-entropy (nats/token) on answer tokens of the held-out split, per domain."""
    model.eval()
    losses = {}
    for domain in DOMAINS:
        total, count = 0.0, 0
        for turns in load_conversations(corpus, "heldout", domain)[:limit]:
            ids, mask = render(tokenizer, turns)
            ids, mask = ids[:1024], mask[:1024]
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
            m = torch.tensor(mask[1:], dtype=torch.bool)
            total += float(nll[m].sum())
            count += int(m.sum())
        losses[domain] = total / max(1, count)
    model.train()
    return losses


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def write_card(out: Path, args, model, tokens_seen: int, seconds: float, losses: dict[str, float]) -> None:
    """Write the model card README.md."""
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    lines = [
        f"# {args.name}",
        "",
        f"A `Qwen3ForCausalLM` trained from scratch for dspark ({args.role}).",
        "",
        f"- parameters: {params / 1e6:.2f}M ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, MLP {cfg.intermediate_size}, "
        f"vocabulary {cfg.vocab_size}, tied embeddings: {cfg.tie_word_embeddings})",
        f"- training: {tokens_seen / 1e6:.2f}M tokens of the bundled corpus (code, prose, math; see "
        f"`scripts/build_corpus.py`), sequence length {args.seq_len}, batch {args.batch}, AdamW lr {args.lr}, "
        f"bf16 autocast, seed {args.seed}; {seconds / 60:.1f} minutes on 2 CPU cores",
        "- held-out cross-entropy on answer tokens (nats/token, first 200 held-out conversations per domain, "
        "float32 weights before the bf16 rounding they are stored with): "
        + ", ".join(f"{d} {v:.3f}" for d, v in losses.items()),
        "",
        "Built with:",
        "",
        "```",
        "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="dspark-target")
    parser.add_argument("--role", default="the bundled target model")
    parser.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=float, default=5e6, help="training tokens")
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=200, help="steps between resumable checkpoints")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    model.train()
    data = packed_stream(tokenizer, args.corpus, args.seq_len, args.seed)
    steps = int(args.tokens // (args.batch * args.seq_len))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; corpus {data.numel() / 1e6:.2f}M tokens; "
          f"{steps} steps of {args.batch}x{args.seq_len}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = args.out / "_train_state"
    step = load_train_state(ckpt, model, opt)[0] if has_train_state(ckpt) else 0
    if step:
        print(f"resumed at step {step}", flush=True)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train_log.jsonl", "a")
    bar = tqdm(range(step, steps), initial=step, total=steps, desc="train", mininterval=10)
    for step in bar:
        idx = [(step * args.batch + i) % len(data) for i in range(args.batch)]
        batch = data[order[idx]]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if log:
                log.write(json.dumps({"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]}) + "\n")
                log.flush()
        if (step + 1) % args.ckpt_every == 0:
            save_train_state(ckpt, model, opt, step + 1, {})
    seconds = time.time() - start
    losses = heldout_loss(model, tokenizer, args.corpus)
    print("held-out loss:", losses, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(args.out)  # bf16 on disk keeps the zoo small
    tokenizer.save_pretrained(args.out)
    write_card(args.out, args, model, steps * args.batch * args.seq_len, seconds, losses)
    for f in ckpt.glob("*"):
        f.unlink()
    if ckpt.exists():
        ckpt.rmdir()


if __name__ == "__main__":
    main()
