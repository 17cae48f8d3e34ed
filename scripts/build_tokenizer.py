"""Train the bundled byte-level BPE tokenizer on the training corpus and save it for AutoTokenizer."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def iter_texts(corpus: Path, domains: list[str]):
    """Yield the user and assistant texts of every training conversation."""
    for domain in domains:
        with open(corpus / f"{domain}_train.jsonl", encoding="utf-8") as f:
            for line in f:
                yield from json.loads(line)["turns"]


def build(corpus: Path, out: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with the chat special tokens and save it to `out`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(corpus, ["code", "prose", "math"]), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--out", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    fast = build(args.corpus, args.out, args.vocab_size)
    digest = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()
    print(f"tokenizer: {len(fast)} tokens, eos={fast.eos_token_id}, mask={fast.mask_token_id}, sha256={digest}")


if __name__ == "__main__":
    main()
