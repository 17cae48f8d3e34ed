"""Prompt files for `dspark regenerate`: JSONL in the common chat shapes and Hugging Face datasets on disk."""
import json

import pytest

from dspark.training.prompts import read_prompts

ROWS = [
    {"turns": ["Write a haiku.", "Another one."]},
    {"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is RoPE?"}]},
    {"conversations": [{"from": "human", "value": "Sort a list in Python."}, {"from": "gpt", "value": "sorted(x)"}]},
    {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]},
    {"conversations": [{"role": "assistant", "content": "no user turn here"}]},
    {"prompt": "Explain KV caches."},
]
WANT = ["Write a haiku.", "What is RoPE?", "Sort a list in Python.", "Name a prime.", "Explain KV caches."]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_chat_shapes_skip_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert read_prompts(path) == WANT
    assert read_prompts(path, limit=2) == WANT[:2]
    assert read_prompts(path, skip=2) == WANT[2:]  # skip counts rows, as --skip extends a regeneration
    assert read_prompts(path, skip=2, limit=2) == WANT[2:4]


def test_bad_rows_and_paths_are_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"text": "no chat here"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a 'turns', 'conversations', 'messages' or 'prompt'"):
        read_prompts(path)
    with pytest.raises(FileNotFoundError, match="no prompt file or dataset"):
        read_prompts(tmp_path / "missing.jsonl")


def test_hugging_face_datasets_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [r for r in ROWS if "messages" in r or ("conversations" in r and "role" in r["conversations"][0])]
    want = read_prompts(write_jsonl(tmp_path / "same.jsonl", rows))
    assert want == ["What is RoPE?", "Name a prime."]
    ds = datasets.Dataset.from_list([{"messages": r.get("messages", r.get("conversations"))} for r in rows])
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "data.parquet"))
    assert read_prompts(tmp_path / "saved") == want
    assert read_prompts(tmp_path / "data.parquet") == want
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert read_prompts(arrow, limit=1) == want[:1]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "splits"))
    assert read_prompts(tmp_path / "splits") == want
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "test_only"))
    with pytest.raises(ValueError, match=r"splits \['test'\]"):
        read_prompts(tmp_path / "test_only")
