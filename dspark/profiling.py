"""Step-cost profiling: time real decoding steps and keep the table, keyed by what it was measured on.

`profile_steps` runs `dspark.decoding.decode` itself at each batch size B with every request verifying
exactly ℓ drafts (ℓ = 0..γ), so a cell times what serving runs: drafting for B requests, one target pass
over N = B·(1 + ℓ) query tokens, verification and commit / rollback. A run without drafting gives the plain
step. The result is a `CostModel` plus a fingerprint of the setup (models, dtype, device, threads, torch,
CPU, context length); `load_profile` refuses a table measured on another setup, naming what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.atomic import read_json, save_figure_atomic, write_text_atomic
from dspark.cost_fit import fit_row
from dspark.decoding import StepInfo, decode, drafter_gamma
from dspark.drafters.base import DraftBlock, Drafter
from dspark.sampling import SamplingParams
from dspark.scheduling import CostModel, Scheduler, StepPlan, lookup_for, step_tokens
from dspark.target import CausalLM

FORMAT = "dspark-step-profile"
VERSION = 1
LAYOUT = "padded"
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: fields every fingerprint holds (nested ones compare by their dotted sub-fields)
FINGERPRINT_FIELDS = ("target", "drafter", "dtype", "device", "threads", "torch", "cpu", "context_len", "layout")
#: HF config keys that say where or by which version a model was saved, not what it is
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")


class ProfileMismatch(ValueError):
    """A step profile was measured on a different setup; `differences` maps field -> (file value, expected)."""

    def __init__(self, path: str | Path, differences: dict[str, tuple[object, object]]) -> None:
        self.path = Path(path)
        self.differences = differences
        super().__init__(f"{path}: step profile was measured on a different setup: {self.summary}")

    @property
    def summary(self) -> str:
        """'field: file has X, this run has Y; ...' for every differing field."""
        return "; ".join(f"{k}: file has {a!r}, this run has {b!r}" for k, (a, b) in self.differences.items())


@dataclass
class StepProfile:
    """A profiled cost table, the fingerprint of the setup it was measured on, and the raw repeat times.

    meta holds gamma, batches, warmup, reps, context_len, prompt_source, seconds (profiling wall time),
    plain_times {B: [s, ...]} and drafted_times {B: {N: [s, ...]}} (the repeats behind each cell), and
    smoothed_rows [B, ...] (the rows fitted by `dspark.cost_fit.fit_row` rather than kept as medians).
    """

    cost: CostModel
    fingerprint: dict
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        context = self.meta.get("context_len", self.fingerprint.get("context_len"))
        if context is not None:  # the table's rows held this many slots: `CostModel.set_context` prices others
            self.cost.reference_slots = int(context)
        self.cost.lookup = lookup_for(self.fingerprint.get("device", "cpu"))  # how the device's steps grow

    def to_dict(self) -> dict:
        """The JSON document `save` writes."""
        return {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                "cost": self.cost.to_dict(), "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON atomically (a temp file in the same folder, then os.replace)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    def missing(self, batches: Sequence[int], gamma: int) -> list[int]:
        """Batch sizes of `batches` whose plain step or drafted cells N = B·(1 + ℓ), ℓ ≤ gamma, are absent."""
        out = []
        for b in batches:
            have = {n for n, _ in self.cost.drafted.get(int(b), [])}
            if int(b) not in self.cost.plain or not {b * (1 + k) for k in range(gamma + 1)} <= have:
                out.append(int(b))
        return out

    def refitted(self) -> StepProfile:
        """This profile with every drafted row that has its repeats in meta["drafted_times"] rebuilt from them
        (`dspark.cost_fit.fit_row`), as `profile_steps` builds rows now; other rows stay."""
        drafted = dict(self.cost.drafted)
        smoothed = set(self.meta.get("smoothed_rows", []))
        for b, cells in self.meta.get("drafted_times", {}).items():
            drafted[int(b)], fitted = fit_row({int(n): v for n, v in cells.items()})
            (smoothed.add if fitted else smoothed.discard)(int(b))
        meta = {**self.meta, "smoothed_rows": sorted(smoothed)}
        cost = CostModel(drafted, dict(self.cost.plain), self.cost.layout, draft_slot=dict(self.cost.draft_slot),
                         width=self.cost.width)
        return StepProfile(cost, self.fingerprint, meta)

    def merged(self, other: StepProfile) -> StepProfile:
        """This profile with `other`'s batch sizes added (other wins where both have one)."""
        drafted = {**self.cost.drafted, **other.cost.drafted}
        plain = {**self.cost.plain, **other.cost.plain}
        meta = dict(self.meta)
        for key in ("plain_times", "drafted_times", "draft_call_times"):
            meta[key] = {**self.meta.get(key, {}), **other.meta.get(key, {})}
        meta["batches"] = sorted(drafted)
        meta["smoothed_rows"] = sorted({b for b in self.meta.get("smoothed_rows", []) if b not in other.cost.drafted}
                                       | set(other.meta.get("smoothed_rows", [])))
        meta["seconds"] = float(self.meta.get("seconds", 0.0)) + float(other.meta.get("seconds", 0.0))
        # per-slot costs only where both profiles drafted at one width (else the other's are dropped: unknown)
        same = self.cost.width == other.cost.width
        slots = {**self.cost.draft_slot, **other.cost.draft_slot} if same else dict(self.cost.draft_slot)
        missing = [b for b in drafted if b not in slots]
        width = self.cost.width if slots and not missing else None
        cost = CostModel(drafted, plain, self.cost.layout, draft_slot=slots if width else {}, width=width)
        return StepProfile(cost, self.fingerprint, meta)


# ------------------------------------------------------------------------------------------------------
# fingerprints


def _sha(data: object) -> str:
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hf_config(model) -> dict:
    cfg = model.config.to_dict()
    return {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}


def _module_shapes(module: torch.nn.Module) -> list:
    return [[name, list(p.shape), str(p.dtype)] for name, p in module.named_parameters()]


_NOT_SETUP = {"calibration", "report_peaks", "draft_limit"}  # survival estimates, the engine's peaks switch and
# the width the last drafting call was asked for are not the setup


def _drafter_description(drafter: Drafter) -> dict:
    """What a drafter is, as hashable data: class, scalar settings, config and parameter shapes."""
    desc: dict = {"class": type(drafter).__name__, "gamma": drafter_gamma(drafter)}
    for key, value in sorted(vars(drafter).items()):
        if key in _NOT_SETUP or key.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            desc[key] = value
    cfg = getattr(drafter, "cfg", None)
    if is_dataclass(cfg):
        desc["config"] = asdict(cfg)
    module = getattr(drafter, "model", None)
    lm = getattr(drafter, "lm", None)
    if isinstance(lm, CausalLM):
        module = lm.model
        desc["config"] = _hf_config(lm.model)
    if isinstance(module, torch.nn.Module):
        desc["weights"] = _module_shapes(module)
    return desc


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor() (or 'unknown')."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def fingerprint_for(target: CausalLM, drafter: Drafter | None, drafter_name: str | None = None,
                    context_len: int = 256) -> dict:
    """The setup a profile of (target, drafter) at `context_len` would be measured on, without profiling."""
    model = target.model
    path = getattr(model.config, "_name_or_path", "") or ""
    target_fp = {
        "path": Path(path).name if path else type(model).__name__,
        "config_sha": _sha(_hf_config(model)),
        "params": int(sum(p.numel() for p in model.parameters())),
    }
    if drafter is None or drafter_gamma(drafter) == 0:
        drafter_fp = {"name": "none", "sha": "none"}
    else:
        drafter_fp = {"name": str(drafter_name or getattr(drafter, "name", type(drafter).__name__)),
                      "sha": _sha(_drafter_description(drafter))}
    device = target.device
    device_name = str(device)
    if device.type == "cuda":
        device_name = f"{device} ({torch.cuda.get_device_name(device)})"
    return {
        "target": target_fp,
        "drafter": drafter_fp,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": device_name,
        "threads": int(torch.get_num_threads()),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "context_len": int(context_len),
        "layout": LAYOUT,
    }


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def fingerprint_differences(found: dict, expected: dict) -> dict[str, tuple[object, object]]:
    """Dotted field -> (found value, expected value) for every field that differs ('<missing>' if absent)."""
    a, b = _flatten(found), _flatten(expected)
    return {k: (a.get(k, "<missing>"), b.get(k, "<missing>"))
            for k in sorted(set(a) | set(b)) if a.get(k, "<missing>") != b.get(k, "<missing>")}


def default_profile_path(fingerprint: dict) -> Path:
    """Where the profile of a setup is cached: $DSPARK_CACHE/profiles/ or ~/.cache/dspark/profiles/<sha>.json."""
    root = os.environ.get("DSPARK_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "dspark"
    return base / "profiles" / f"{_sha(fingerprint)}.json"


# ------------------------------------------------------------------------------------------------------
# measuring


class _Enough(Exception):
    """Raised from on_step to stop a decode once a cell has all its steps."""


class _FullBlock(Drafter):
    """Delegates to a drafter and pads short rows to γ drafts (repeating the anchor), so every row verifies
    exactly ℓ drafts. Only drafters that can come up short (n-gram lookup) ever get padded."""

    def __init__(self, inner: Drafter, gamma: int) -> None:
        self.inner = inner
        self.gamma = gamma
        self.name = getattr(inner, "name", "drafter")
        self.feature_layers = tuple(getattr(inner, "feature_layers", ()))

    def reset(self) -> None:
        self.inner.reset()

    def join(self, prompts, prefill_features) -> None:
        self.inner.join(prompts, prefill_features)

    def observe(self, outcome) -> None:
        self.inner.observe(outcome)

    def select(self, rows) -> None:
        self.inner.select(rows)

    def propose(self, sequences, sampling, generators) -> DraftBlock:
        self.inner.draft_limit = self.draft_limit
        block = self.inner.propose(sequences, sampling, generators)
        if bool((block.lengths >= min(self.gamma, self.draft_limit or self.gamma)).all()):
            return block
        rows, device = len(sequences), block.lengths.device
        tokens = torch.tensor([[s[-1]] * self.gamma for s in sequences], dtype=torch.long, device=device)
        width = min(self.gamma, block.tokens.shape[1])
        keep = torch.arange(width, device=device).view(1, -1) < block.lengths.view(-1, 1)
        tokens[:, :width] = torch.where(keep, block.tokens[:, :width], tokens[:, :width])
        probs = confidences = None
        if block.probs is not None:
            probs = torch.nn.functional.one_hot(tokens, block.probs.shape[-1]).to(block.probs.dtype)
            probs[:, :width] = torch.where(keep.unsqueeze(-1), block.probs[:, :width], probs[:, :width])
        if block.confidences is not None:
            confidences = torch.zeros(rows, self.gamma, dtype=block.confidences.dtype, device=device)
            confidences[:, :width] = torch.where(keep, block.confidences[:, :width], confidences[:, :width])
        peaks = None
        if block.peaks is not None:
            peaks = torch.full((rows, self.gamma), float("nan"), dtype=block.peaks.dtype, device=device)
            peaks[:, :width] = torch.where(keep, block.peaks[:, :width], peaks[:, :width])
        lengths = torch.full((rows,), self.gamma, dtype=torch.long, device=device)
        return DraftBlock(tokens, lengths, probs, confidences, peaks)


def _eval_token_stream(target: CausalLM) -> list[int]:
    """The bundled evaluation prompts (domains interleaved), tokenized and concatenated; [] without them."""
    if target.tokenizer is None:
        return []
    from dspark.evaluation.bench import load_eval_prompts
    from dspark.zoo import DOMAINS

    try:
        per_domain = [load_eval_prompts(d, 10**6) for d in DOMAINS]
    except (OSError, ValueError, KeyError):
        return []
    texts = [t for group in zip(*per_domain) for t in group]
    ids: list[int] = []
    for text in texts:
        ids.extend(int(i) for i in target.tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
    return [i for i in ids if 0 <= i < target.vocab_size]


def profile_prompts(target: CausalLM, batch: int, context_len: int, seed: int = 0,
                    stream: list[int] | None = None) -> tuple[list[list[int]], str]:
    """`batch` prompts of `context_len` token ids: distinct windows of the bundled eval prompts when the
    target has a tokenizer and they are long enough, else seeded random ids. Returns (prompts, source)."""
    ids = _eval_token_stream(target) if stream is None else stream
    if len(ids) >= context_len:
        span = len(ids) - context_len + 1
        stride = max(1, span // max(1, batch))
        return [ids[(r * stride) % span:(r * stride) % span + context_len] for r in range(batch)], "eval-prompts"
    g = torch.Generator().manual_seed(seed + batch)
    return torch.randint(0, target.vocab_size, (batch, context_len), generator=g).tolist(), "random"


NARROW = -1  # the cell that drafts one slot and verifies none (with ℓ = 0 at the full width: the slot's cost)


class _Rotating(Scheduler):
    """Cycles through the cells of one batch size, one step each: plain (no drafting), then ℓ = 0..γ drafts
    for every request drafted γ wide (drafting even at ℓ = 0, like an adaptive step that admits nothing),
    then (γ > 1) ℓ = 0 drafted one slot wide (`NARROW`). Interleaving the cells spreads machine noise over all
    of them alike."""

    def __init__(self, gamma: int, with_drafts: bool) -> None:
        super().__init__("fixed", gamma)
        self.cycle: list[int | None] = [None]
        if with_drafts:
            self.cycle += list(range(gamma + 1)) + ([NARROW] if gamma > 1 else [])
        self.step = -1

    def current(self) -> int | None:
        return self.cycle[self.step % len(self.cycle)]

    @property
    def draft_limit(self) -> int | None:
        return 1 if self.current() == NARROW else self.gamma

    def wants_drafts(self, num_rows: int) -> bool:
        self.step += 1
        return self.current() is not None

    def plan(self, survival, limits, cost=None, token_budget=None, request_ids=None) -> StepPlan:
        return StepPlan([min(max(0, int(self.current())), int(x)) for x in limits])


def _time_cells(target: CausalLM, drafter: Drafter, prompts: list[list[int]], gamma: int, with_drafts: bool,
                warmup: int, reps: int, max_new_tokens: int) -> tuple[dict, dict, int]:
    """Step seconds per cell key (None: plain, ℓ: drafts per request, NARROW) from one decode of these prompts,
    `warmup` + `reps` steps each, the cells taking turns. Returns (times after warm-up, the drafting calls'
    seconds of those steps per key, dropped steps)."""
    batch, need = len(prompts), warmup + reps
    sched = _Rotating(gamma, with_drafts)
    times: dict = {key: [] for key in sched.cycle}
    drafting: dict = {key: [] for key in sched.cycle}
    dropped = 0

    def on_step(info: StepInfo) -> None:
        nonlocal dropped
        key = sched.current()
        expect = batch if key is None else step_tokens(np.full(batch, max(0, key)), LAYOUT)
        if info.batch == batch and info.drafted == (key is not None) and info.tokens == expect:
            times[key].append(info.seconds)
            drafting[key].append(info.draft_seconds)
        else:
            dropped += 1
        if all(len(t) >= need for t in times.values()):
            raise _Enough

    try:
        decode(target, drafter, prompts, SamplingParams(), max_new_tokens, eos_token_ids=frozenset(),
               scheduler=sched, on_step=on_step, online_cost=False)
    except _Enough:
        pass
    short = {k: len(t) for k, t in times.items() if len(t) < need}
    if short:
        raise RuntimeError(f"profiling B={batch}: cells {short} got fewer than {need} matching steps "
                           f"({dropped} steps had another batch size or token count); raise the context room")
    return {k: t[warmup:] for k, t in times.items()}, {k: t[warmup:] for k, t in drafting.items()}, dropped


def profile_steps(target: CausalLM, drafter: Drafter, batches: Sequence[int] = DEFAULT_BATCHES,
                  context_len: int = 256, warmup: int = 2, reps: int = 5, gamma: int | None = None,
                  drafter_name: str | None = None, progress: bool = True) -> StepProfile:
    """Time decoding steps through `decode` at each batch size and every verified-draft count ℓ = 0..γ.

    Cell (B, N = B·(1 + ℓ)) comes from `reps` steps (after `warmup`) in which B requests each verified exactly ℓ
    drafts of a γ-slot block (greedy, no EOS, every row drafts; short n-gram rows are padded): a batch row's cells are its medians
    smoothed by `dspark.cost_fit.fit_row` (two lines meeting at a knee) unless the medians depart from the fit by
    more than their noise explains (meta["smoothed_rows"] lists the smoothed rows); plain[B] is the median
    step of target-only decoding (the drafter is not called). draft_slot[B] is what one drafted slot adds: the
    median drafting call of the steps drafting the full width (every ℓ) less that of `reps` steps drafting a
    single slot, over γ − 1, never negative (the calls alone: the whole steps' noise would swamp a slot;
    meta["draft_call_times"] keeps both). Prompts are `context_len` tokens; one decode
    per batch size runs the cells in turn, one step each, so the context grows by up to a few hundred
    tokens over the profile and noise falls on every cell alike.
    A target-only profile (γ = 0) has the single drafted cell N = B equal to the plain step.
    """
    from tqdm.auto import tqdm

    full = drafter_gamma(drafter)
    gamma = full if gamma is None else int(gamma)
    if not 0 <= gamma <= full:
        raise ValueError(f"gamma must be in [0, {full}] (the drafter's block), got {gamma}")
    if warmup < 0 or reps < 1:
        raise ValueError(f"need warmup >= 0 and reps >= 1, got warmup={warmup} reps={reps}")
    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batches}")
    limit = getattr(target.model.config, "max_position_embeddings", None) or 10**9
    room = limit - context_len
    if context_len < 2 or room < gamma + 2:
        raise ValueError(f"context_len={context_len} leaves {room} of the target's {limit} positions for "
                         f"decoding; need context_len >= 2 and at least {gamma + 2} positions free")
    runner = _FullBlock(drafter, full) if full > 0 else drafter
    stream = _eval_token_stream(target)
    fingerprint = fingerprint_for(target, drafter, drafter_name, context_len)
    drafted: dict[int, list[tuple[int, float]]] = {}
    plain: dict[int, float] = {}
    draft_slot: dict[int, float] = {}
    meta: dict = {"gamma": gamma, "batches": batches, "warmup": warmup, "reps": reps, "context_len": context_len,
                  "plain_times": {}, "drafted_times": {}, "draft_call_times": {}, "dropped_steps": 0,
                  "smoothed_rows": []}
    cells = (gamma + 2 + (gamma > 1)) if full else 1
    bar = tqdm(total=len(batches) * cells, desc="profiling steps", disable=not progress, unit="cell", file=sys.stderr)
    start = time.perf_counter()
    for b in batches:
        prompts, meta["prompt_source"] = profile_prompts(target, b, context_len, stream=stream)
        bar.set_postfix(B=b)
        cycle_tokens = 1 + sum(ell + 1 for ell in range(gamma + 1)) + 1 if full else 1
        times, calls, dropped = _time_cells(target, runner, prompts, gamma, bool(full), warmup, reps,
                                     min(room, (warmup + reps + 1) * cycle_tokens + 1))
        meta["dropped_steps"] += dropped
        plain[b] = float(np.median(times[None]))
        meta["plain_times"][str(b)] = times[None]
        if not full:
            drafted[b] = [(b, plain[b])]
        else:
            drafted[b], smoothed = fit_row({b * (1 + ell): times[ell] for ell in range(gamma + 1)})
            meta["drafted_times"][str(b)] = {str(b * (1 + ell)): times[ell] for ell in range(gamma + 1)}
            if smoothed:
                meta["smoothed_rows"].append(b)
            if NARROW in times:
                whole = [t for ell in range(gamma + 1) for t in calls[ell]]
                meta["draft_call_times"][str(b)] = {"full": whole, "narrow": calls[NARROW]}
                slope = (np.median(whole) - np.median(calls[NARROW])) / (gamma - 1)
                draft_slot[b] = float(max(0.0, slope))
        bar.update(cells)
    bar.close()
    drafter.draft_limit = None  # the profile's last cell set it
    meta["seconds"] = time.perf_counter() - start
    cost = CostModel(drafted, plain, LAYOUT, draft_slot=draft_slot, width=gamma if draft_slot else None)
    return StepProfile(cost, fingerprint, meta)


# ------------------------------------------------------------------------------------------------------
# files


def load_profile(path: str | Path, expect: dict | None = None) -> StepProfile:
    """Read a saved profile; a missing, truncated or malformed file, field or cell fails naming it.

    With `expect` (a fingerprint), a profile measured on another setup raises `ProfileMismatch` naming every
    differing field with both values.
    """
    path = Path(path)
    data = read_json(path, "step profile")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004 (a bad file)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: field 'version' is {data.get('version')!r}; this dspark reads version {VERSION}")
    for key in ("fingerprint", "cost", "meta"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"{path}: field {key!r} is missing or not an object")  # noqa: TRY004
    fingerprint, meta = data["fingerprint"], data["meta"]
    for key in FINGERPRINT_FIELDS:
        if key not in fingerprint:
            raise ValueError(f"{path}: field 'fingerprint.{key}' is missing")
    cost = CostModel.from_dict(data["cost"], where=f"{path}: field 'cost'")
    gamma = meta.get("gamma")
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"{path}: field 'meta.gamma' is missing or not a non-negative integer")
    for b in sorted(set(cost.drafted) | set(cost.plain)):
        if b not in cost.plain:
            raise ValueError(f"{path}: field 'cost.plain' lacks the plain step of batch size {b}")
        have = {n for n, _ in cost.drafted.get(b, [])}
        for ell in range(gamma + 1):
            if b * (1 + ell) not in have:
                raise ValueError(f"{path}: field 'cost.drafted.{b}' lacks the cell N={b * (1 + ell)} "
                                 f"({ell} drafts per request)")
    if expect is not None:
        diff = fingerprint_differences(fingerprint, expect)
        if diff:
            raise ProfileMismatch(path, diff)
    return StepProfile(cost, fingerprint, meta)


def load_or_profile(target: CausalLM, drafter: Drafter, drafter_name: str | None = None,
                    batches: Sequence[int] = DEFAULT_BATCHES, path: str | Path | None = None,
                    reprofile: bool = True, **kw) -> CostModel:
    """The cost model of this setup: from the profile at `path` (default: the fingerprint's cache path) when
    it was measured on this setup, profiling and saving otherwise.

    A file from another setup (or unreadable) is re-profiled with a note on stderr naming what differed, or
    raises `ProfileMismatch` / ValueError when reprofile is False; a wrong table is never used. A file without
    per-slot drafting costs (an older dspark's) is re-profiled too, or used as it is (the drafted width then
    costs nothing) when reprofile is False. Batch sizes
    the file lacks are profiled and added to it. `kw` goes to `profile_steps` (context_len, reps, ...).
    """
    context_len = int(kw.get("context_len", 256))
    fingerprint = fingerprint_for(target, drafter, drafter_name, context_len)
    path = Path(path) if path is not None else default_profile_path(fingerprint)
    gamma = drafter_gamma(drafter) if kw.get("gamma") is None else int(kw["gamma"])
    batches = sorted({int(b) for b in batches})
    existing: StepProfile | None = None
    if path.exists():
        try:
            existing = load_profile(path, expect=fingerprint)
        except ProfileMismatch as err:
            if not reprofile:
                raise
            print(f"dspark: {path} was profiled on a different setup ({err.summary}); re-profiling", file=sys.stderr)
        except ValueError as err:
            if not reprofile:
                raise
            print(f"dspark: cannot use the step profile ({err}); re-profiling", file=sys.stderr)
    if existing is not None and existing.meta.get("gamma", 0) < gamma:
        print(f"dspark: {path} covers {existing.meta.get('gamma')} drafts per request, {gamma} are needed; "
              f"re-profiling", file=sys.stderr)
        existing = None
    if existing is not None and gamma > 1 and existing.cost.width is None and reprofile:
        print(f"dspark: {path} was profiled without the drafter's per-slot cost (an older dspark); re-profiling",
              file=sys.stderr)
        existing = None
    if existing is not None:
        missing = existing.missing(batches, gamma)
        if not missing:
            return existing.cost
        added = profile_steps(target, drafter, missing, drafter_name=drafter_name, **kw)
        profile = existing.merged(added)
    else:
        profile = profile_steps(target, drafter, batches, drafter_name=drafter_name, **kw)
    profile.save(path)
    return profile.cost


# ------------------------------------------------------------------------------------------------------
# plotting


def plot_profile(profile: StepProfile, path: str | Path) -> Path:
    """PNG (Agg) of the table: seconds per step against query tokens N (one line per B, the repeats' range as
    error bars, the plain step as a star at N = B), and each cell relative to the plain step of its B."""
    import matplotlib
    import matplotlib.ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cost, meta = profile.cost, profile.meta
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)  # Agg rendering without touching pyplot's global backend
    left, right = fig.subplots(1, 2)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(1, len(cost.drafted))))
    for color, (b, cells) in zip(colors, sorted(cost.drafted.items())):
        ns = np.array([n for n, _ in cells])
        secs = np.array([s for _, s in cells])
        reps = meta.get("drafted_times", {}).get(str(b), {})
        med = np.array([float(np.median(reps[str(n)])) if reps.get(str(n)) else secs[i] for i, n in enumerate(ns)])
        lo = np.array([med[i] - min(reps.get(str(n), [med[i]])) for i, n in enumerate(ns)])
        hi = np.array([max(reps.get(str(n), [med[i]])) - med[i] for i, n in enumerate(ns)])
        left.errorbar(ns, med * 1e3, yerr=[lo * 1e3, hi * 1e3], color=color, marker="o", ms=3, capsize=2,
                      ls="none")
        left.plot(ns, secs * 1e3, color=color, label=f"B={b}")
        if b in cost.plain:
            left.plot([b], [cost.plain[b] * 1e3], marker="*", ms=12, color=color, mec="black", ls="none")
            right.plot(ns / b - 1, secs / cost.plain[b], color=color, marker="o", ms=3, label=f"B={b}")
    left.plot([], [], marker="*", ms=12, color="grey", mec="black", ls="none", label="plain (no drafting)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    plain_numbers = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
    left.xaxis.set_major_formatter(plain_numbers)
    left.yaxis.set_major_formatter(plain_numbers)
    left.set(xlabel="query tokens per step N = B·(1+ℓ)", ylabel="ms per step",
             title="step time (line: the cost table; dots: medians, bars: min–max of repeats)")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    right.set(xlabel="drafts verified per request ℓ", ylabel="step time / plain step (same B)",
              title="cost of drafting and verifying ℓ drafts")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fp = profile.fingerprint
    fig.suptitle(f"{fp.get('target', {}).get('path', '?')} + {fp.get('drafter', {}).get('name', '?')}, "
                 f"{fp.get('dtype')}, {fp.get('device')}, {fp.get('threads')} threads, "
                 f"context {fp.get('context_len')}", fontsize=10)
    fig.tight_layout()
    return save_figure_atomic(fig, path)
