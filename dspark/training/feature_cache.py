"""Frozen-target outputs cached to safetensors shards: one target pass over a data set, reused by every run.

Drafter training needs, per sequence, the hidden states of some target layers (the drafter's context
features) and the target's distribution at every position. Computing them on the fly costs one target
forward per sequence per epoch; a cache costs one forward in all. Per row it stores

* `feats.{row}` [S, m·d]: the hidden states of the cached layers (layer id i is `hidden_states[i + 1]`),
* `final.{row}` [S, d]: the input of the target's LM head, from which the logits are recomputed exactly.

Rows are grouped into shards written atomically, each tagged with the cache's key (target fingerprint,
data fingerprint, layers, dtype): a killed build resumes by skipping finished shards, and a cache that
does not belong to the target, data or layers at hand fails with a message naming the field.
Stored in bfloat16 by default, which is exact for bf16-autocast training: the drafter's projections and
the LM head cast their inputs to bfloat16 anyway.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from tqdm import tqdm

from dspark.atomic import (FileReadError, open_safetensors, read_json, remove_stale_temps, save_safetensors_atomic,
                           write_text_atomic)

CACHE_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def target_fingerprint(target_model: torch.nn.Module) -> str:
    """Hash of the target's config and a strided sample of every parameter (cheap even for large models)."""
    h = hashlib.sha256(json.dumps(target_model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in sorted(target_model.named_parameters()):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def data_fingerprint(sequences: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Hash of every sequence's token ids and loss mask, in order."""
    h = hashlib.sha256()
    for ids, mask in sequences:
        h.update(ids.to(torch.int64).numpy().tobytes())
        h.update(b"|")
        h.update(mask.to(torch.int64).numpy().tobytes())
        h.update(b";")
    return h.hexdigest()[:16]


@torch.no_grad()
def target_outputs(target_model: torch.nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One frozen-target pass over a sequence [S]: (features [S, m·d], LM-head input [S, d], logits [S, V])."""
    captured = []
    hook = target_model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        out = target_model(input_ids=input_ids.unsqueeze(0), output_hidden_states=True)
    finally:
        hook.remove()
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1)
    return feats, captured[-1][0], out.logits[0]


class FeatureCache:
    """A built cache: `target_pass(row, target_model, layer_ids)` returns what the on-the-fly pass returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "index.json"
        if not index.exists():
            raise FileNotFoundError(f"{self.path} is not a finished feature cache (no index.json)")
        self.meta = read_json(index, "feature cache index")
        version = self.meta.get("version") if isinstance(self.meta, dict) else None
        if version != CACHE_VERSION:
            raise ValueError(f"feature cache {self.path}: version is {version} in the cache "
                             f"but this dspark reads version {CACHE_VERSION}")
        self._open: dict[int, object] = {}

    def check(self, target_model: torch.nn.Module, sequences: Sequence, layer_ids: Sequence[int],
              autocast_bf16: bool) -> None:
        """Fail, naming the field and both values, unless the cache holds these sequences of this target,
        the drafter's layers, and was computed with the run's precision (bf16 autocast or float32); a
        missing or torn shard fails here, naming it."""
        expected = {"target": target_fingerprint(target_model), "num_rows": len(sequences),
                    "data": data_fingerprint(sequences), "autocast_bf16": bool(autocast_bf16)}
        for field, value in expected.items():
            if self.meta[field] != value:
                raise ValueError(f"feature cache {self.path} does not fit this run: {field} is {self.meta[field]!r} "
                                 f"in the cache but {value!r} here")
        if not autocast_bf16 and self.meta["dtype"] != "float32":
            raise ValueError(f"feature cache {self.path}: dtype is {self.meta['dtype']} in the cache but a float32 "
                             "run needs float32 features")
        missing = [i for i in layer_ids if i not in self.meta["layer_ids"]]
        if missing:
            raise ValueError(f"feature cache {self.path} does not fit this drafter: target_layer_ids is "
                             f"{self.meta['layer_ids']} in the cache but the drafter reads {list(layer_ids)}")
        per = self.meta["rows_per_shard"]
        for k in range((self.meta["num_rows"] + per - 1) // per):  # a torn or missing shard fails here, not mid-run
            with open_safetensors(self.path / _shard_name(k), "feature cache shard"):
                pass

    def _shard(self, row: int):
        k = row // self.meta["rows_per_shard"]
        if k not in self._open:
            if len(self._open) >= 4:
                self._open.pop(next(iter(self._open)))
            self._open[k] = open_safetensors(self.path / _shard_name(k), "feature cache shard")
        return self._open[k]

    def target_pass(self, row: int, target_model: torch.nn.Module, layer_ids: Sequence[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [S, m·d] of `layer_ids`, logits [S, V]) of cached row `row`, on the target's device."""
        shard = self._shard(row)
        feats = shard.get_tensor(f"feats.{row}")
        final = shard.get_tensor(f"final.{row}")
        cached = self.meta["layer_ids"]
        if list(layer_ids) != cached:
            d = feats.shape[-1] // len(cached)
            feats = torch.cat([feats[:, cached.index(i) * d : (cached.index(i) + 1) * d] for i in layer_ids], -1)
        lm_head = target_model.get_output_embeddings()
        device = lm_head.weight.device
        with torch.no_grad():
            logits = lm_head(final.to(device))
        return feats.to(device), logits


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _shard_done(path: Path, key: str) -> bool:
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("key") == key
    except Exception:  # a torn or foreign file: build it again
        return False


def build_feature_cache(
    target_model: torch.nn.Module,
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layer_ids: Sequence[int],
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    rows_per_shard: int = 256,
    autocast: bool = True,
) -> FeatureCache:
    """Run the frozen target over `sequences` and write the cache to `out`; return it.

    A finished cache of the same target, data and layers is reused as it is; a killed build resumes at
    the first unfinished shard; a folder that holds another cache is an error (nothing is overwritten).
    `autocast` runs the target under bf16 autocast, as training does. Under torchrun, rank r builds
    shards r, r + world, … and every rank returns once the index is written.
    """
    import torch.distributed as dist

    out = Path(out)
    dtype_name = str(dtype).replace("torch.", "")
    if dtype_name not in _DTYPES:
        raise ValueError(f"cache dtype must be one of {', '.join(_DTYPES)}, got {dtype_name}")
    meta = {"version": CACHE_VERSION, "target": target_fingerprint(target_model), "num_rows": len(sequences),
            "data": data_fingerprint(sequences), "layer_ids": [int(i) for i in layer_ids], "dtype": dtype_name,
            "rows_per_shard": rows_per_shard, "autocast_bf16": bool(autocast)}
    for name in ("index.json", "building.json"):
        if (out / name).exists():
            other = read_json(out / name, "feature cache index")
            if not isinstance(other, dict):
                raise FileReadError(f"feature cache index {out / name} is not a JSON object")
            field = next((f for f in meta if other.get(f) != meta[f]), None)
            if field is not None:
                raise ValueError(f"{out} holds another feature cache: {field} is {other.get(field)!r} there but "
                                 f"{meta[field]!r} for this run; use another folder or delete that one")
            if name == "index.json":
                return FeatureCache(out)
    num_shards = (len(sequences) + rows_per_shard - 1) // rows_per_shard
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for k in range(num_shards):  # temporary files of a builder killed mid-write; no rank writes yet
            remove_stale_temps(out / _shard_name(k))
        _write_json(out / "building.json", meta)
    if distributed:
        dist.barrier()
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    device = next(target_model.parameters()).device
    todo = [k for k in range(rank, num_shards, world) if not _shard_done(out / _shard_name(k), key)]
    target_model.eval()
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    rows = [r for k in todo for r in range(k * rows_per_shard, min((k + 1) * rows_per_shard, len(sequences)))]
    with tqdm(total=len(rows), desc="cache features", disable=rank != 0, mininterval=10) as bar:
        for k in todo:
            tensors = {}
            for row in range(k * rows_per_shard, min((k + 1) * rows_per_shard, len(sequences))):
                with ctx:
                    feats, final, logits = target_outputs(target_model, sequences[row][0].to(device), layer_ids)
                if row == rows[0]:
                    _check_logits_recomputable(target_model, final, logits, ctx)
                tensors[f"feats.{row}"] = feats.to(dtype).cpu().contiguous()
                tensors[f"final.{row}"] = final.to(dtype).cpu().contiguous()
                bar.update(1)
            save_safetensors_atomic(out / _shard_name(k), tensors, metadata={"key": key})
    if distributed:
        dist.barrier()
    if rank == 0:
        _write_json(out / "index.json", meta)
        (out / "building.json").unlink()
    if distributed:
        dist.barrier()
    return FeatureCache(out)


def _write_json(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))


def _check_logits_recomputable(target_model, final: torch.Tensor, logits: torch.Tensor, ctx) -> None:
    """The cache recomputes logits as lm_head(final); a target that post-processes them cannot be cached."""
    with torch.no_grad(), ctx:
        again = target_model.get_output_embeddings()(final)
    err = (again.float() - logits.float()).abs().max().item()
    if err > 1e-3 * max(1.0, logits.float().abs().max().item()):
        raise ValueError(f"this target's logits are not its LM head applied to the last hidden state "
                         f"(max difference {err:.3g}; e.g. logit soft-capping or scaling): train it with "
                         "on-the-fly features instead of a feature cache")
