"""Prompts to regenerate answers for: the first user turn of each conversation in a file or dataset.

Reads JSONL files and Hugging Face datasets on disk (a `Dataset.save_to_disk` folder, a `.parquet` or an
`.arrow` file; these need the `datasets` package). A row may hold `turns` (a list of user turns),
`conversations` or `messages` (chat turns as {role, content} or ShareGPT's {from, value}), or a plain
`prompt` string.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

USER_ROLES = ("user", "human")


def first_user_turn(row: dict[str, Any], where: str) -> str | None:
    """The first user turn of one row (None when the conversation has none)."""
    if "turns" in row:
        return row["turns"][0] if row["turns"] else None
    for key in ("conversations", "messages"):
        if key in row:
            for turn in row[key]:
                if turn.get("role", turn.get("from")) in USER_ROLES:
                    return turn.get("content", turn.get("value"))
            return None
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    raise ValueError(f"{where}: expected a 'turns', 'conversations', 'messages' or 'prompt' field, "
                     f"found {sorted(row)}")


def _hf_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{path}: reading a Hugging Face dataset needs the `datasets` package "
                          "(pip install datasets)") from e
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{path}: a dataset with splits {sorted(ds)}; point to one split's folder")
            ds = ds["train"]
    elif path.suffix == ".parquet":
        ds = datasets.Dataset.from_parquet(str(path))
    else:
        ds = datasets.Dataset.from_file(str(path))
    for i, row in enumerate(ds):
        yield f"{path}: row {i}", row


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{line_no}", json.loads(line)


def read_prompts(path: str | Path, limit: int | None = None, skip: int = 0) -> list[str]:
    """First user turns of the rows of a JSONL file or a Hugging Face dataset on disk.

    `skip` drops the first rows (to extend an earlier regeneration with new ones), `limit` caps the prompts.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no prompt file or dataset at {path}")
    hf = path.is_dir() or path.suffix in (".parquet", ".arrow")
    prompts: list[str] = []
    for seen, (where, row) in enumerate(_hf_rows(path) if hf else _jsonl_rows(path), 1):
        if limit is not None and len(prompts) >= limit:
            break
        prompt = first_user_turn(row, where)
        if seen > skip and prompt:
            prompts.append(prompt)
    return prompts
