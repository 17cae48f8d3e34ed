"""The Python API that mirrors the CLI: load a target and a drafter, generate text from prompts."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from dspark.arguments import check_int, check_text, resolve_device
from dspark.atomic import NO_PICKLE, FileReadError, open_safetensors, pickle_files, read_json
from dspark.decoding import GenerationResult, decode, drafter_gamma
from dspark.drafters.base import Drafter, NoDrafter
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.sampling import SamplingParams
from dspark.scheduling import LOOKUPS, CostModel, Scheduler
from dspark.target import CausalLM
from dspark.zoo import bundled_drafter_path, default_target_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUNDLED_DRAFTERS = ("draft-model", "dflash", "dspark", "dspark-rnn", "eagle3")
DRAFTER_NAMES = ("none", "ngram") + BUNDLED_DRAFTERS


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map 'float32' / 'bfloat16' / 'float16' (or a torch dtype) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_causal_lm(
    path: str | Path, dtype: str | torch.dtype = "bfloat16", device: str = "cpu", feature_layers: Sequence[int] = ()
) -> CausalLM:
    """Load an HF causal LM and its tokenizer from a local folder into a `CausalLM`."""
    resolve_dtype(dtype)
    resolve_device(device)  # an unknown or absent device fails naming it, before anything is read
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {path}: expected a Hugging Face folder with config.json")
    check_model_files(path)
    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype), use_safetensors=True,
                                                       output_loading_info=True)
    missing, mismatched = list(info.get("missing_keys") or []), list(info.get("mismatched_keys") or [])
    if missing or mismatched:  # from_pretrained would fill them with random weights: half a model
        from dspark.checkpoints import CheckpointMismatch

        unexpected = sorted(info.get("unexpected_keys") or [])
        raise CheckpointMismatch(
            f"model folder {path}: its weights do not match its config.json ({model.config.architectures}): "
            f"missing {sorted(missing)[:5]}" + (f", wrong shape {[k for k, *_ in mismatched][:5]}" if mismatched else "")
            + (f", unexpected {unexpected[:5]}" if unexpected else ""))
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    return CausalLM(model, tokenizer, feature_layers=feature_layers)


def check_model_files(path: Path) -> None:
    """Fail naming the file unless the HF folder's config.json parses and its weights are readable
    safetensors (pickled .bin/.pt weights are refused, never unpickled)."""
    read_json(path / "config.json", "model config")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        others = pickle_files(path)
        raise FileReadError(f"model folder {path} has no .safetensors weights"
                            + (f", only {', '.join(others)}" if others else "") + f": {NO_PICKLE}")
    for file in weights:
        with open_safetensors(file, "model weights"):
            pass


def load_target(
    path: str | Path | None = None, dtype: str | torch.dtype = "bfloat16", device: str = "cpu"
) -> CausalLM:
    """Load a target model (default: the bundled one). bfloat16 is the fast default on CPUs and GPUs."""
    return load_causal_lm(path or default_target_path(), dtype, device)


def _check_same_tokenizer(target: CausalLM, draft: CausalLM, where: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {where} does not fit the target: vocab_size is {draft.vocab_size} in the drafter "
            f"but {target.vocab_size} in the target"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if tv != dv:
            diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
            raise ValueError(
                f"drafter {where} does not fit the target: its tokenizer differs from the target's "
                f"(e.g. {diff}); a draft model must share the target's tokenizer"
            )


CALIBRATION_FILE = "calibration.json"


def load_drafter(name_or_path: str | Path, target: CausalLM, gamma: int | None = None,
                 bias_candidates: int | None = None, calibration: str | Path | None = "auto") -> Drafter:
    """Return a drafter for `target` (see `_load_drafter`) with its survival calibration attached.

    calibration: "auto" picks up `calibration.json` beside the checkpoint (for n-gram: zoo/ngram/), ignoring
    with a warning one fitted for another drafter or target; a path loads that file and fails on any
    mismatch; None uses no calibration (the confidence head as is, or a constant prior).
    gamma and bias_candidates: None (the drafter's own) or a positive integer; a bad value fails naming it.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise ValueError(f"name_or_path must be a drafter name ({', '.join(DRAFTER_NAMES)}) or a checkpoint folder, "
                         f"got {name_or_path!r}")
    gamma = None if gamma is None else check_int("gamma", gamma, 1)
    bias_candidates = None if bias_candidates is None else check_int("bias_candidates", bias_candidates, 1)
    drafter = _load_drafter(name_or_path, target, gamma, bias_candidates)
    drafter.calibration = None
    if calibration is None or isinstance(drafter, NoDrafter):
        return drafter
    from dspark.calibration.maps import Calibration
    from dspark.identity import drafter_id, target_id

    if calibration == "auto":
        path = calibration_path(drafter)
        if path is None or not path.exists():
            return drafter
        try:
            drafter.calibration = Calibration.load(path, drafter_id(drafter), target_id(target))
        except ValueError as err:
            print(f"dspark: warning: {err}; using the uncalibrated survival estimate", file=sys.stderr)
        return drafter
    drafter.calibration = Calibration.load(calibration, drafter_id(drafter), target_id(target))
    return drafter


def calibration_path(drafter: Drafter) -> Path | None:
    """Where a drafter's calibration file lives: beside its checkpoint, or zoo/ngram/ for n-gram."""
    if isinstance(drafter, NgramDrafter):
        return bundled_drafter_path("ngram") / CALIBRATION_FILE
    path = getattr(drafter, "source_path", None)
    return None if path is None else Path(path) / CALIBRATION_FILE


def _load_drafter(name_or_path: str | Path, target: CausalLM, gamma: int | None = None,
                  bias_candidates: int | None = None) -> Drafter:
    """Return a drafter for `target`: 'none', 'ngram', a bundled drafter name or a checkpoint folder.

    Checkpoint folders may hold an HF causal LM sharing the target's tokenizer (a draft model) or a
    block drafter (dspark / DeepSpec DSpark or DFlash / z-lab DFlash); the format is detected.
    `bias_candidates` K restricts a block drafter's Markov bias to each slot's top-K base logits
    (BlockDrafter); drafters without a vanilla Markov head ignore it.
    """
    name = str(name_or_path)
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        return NgramDrafter(gamma=gamma or 4)
    path = bundled_drafter_path(name) if name in BUNDLED_DRAFTERS else Path(name)
    if not path.exists():
        if name in BUNDLED_DRAFTERS:
            raise ValueError(f"the bundled drafter {name!r} is not in the zoo ({path}); build it first")
        raise ValueError(
            f"unknown drafter {name!r}: use one of {', '.join(DRAFTER_NAMES)} or the path of a drafter checkpoint"
        )
    if not (path / "config.json").exists():
        raise ValueError(f"drafter path {path} has no config.json")
    from dspark.checkpoints import read_config

    raw = read_config(path)
    if "dflash_config" in raw or "markov_rank" in raw or "Qwen3DSparkModel" in (raw.get("architectures") or []):
        from dspark.checkpoints import load_block_drafter_model
        from dspark.drafters.block import BlockDrafter

        model = load_block_drafter_model(path, target)
        drafter = BlockDrafter(model, target, name=path.name, max_drafts=gamma, bias_candidates=bias_candidates)
        drafter.source_path = path
        return drafter
    if (raw.get("architectures") or [""])[0] in ("Qwen3Eagle3Model", "Eagle3DraftModel", "Eagle3Speculator"):
        from dspark.checkpoints import load_eagle3_model
        from dspark.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter(load_eagle3_model(path, target), target, gamma=gamma)
        drafter.name, drafter.source_path = path.name, path
        return drafter
    draft = load_causal_lm(path, target.dtype, str(target.device))
    _check_same_tokenizer(target, draft, str(path))
    drafter = DraftModelDrafter(draft, gamma=gamma or 4)
    drafter.name, drafter.source_path = path.name, path
    return drafter


def step_cost_model(target: CausalLM, drafter: Drafter, max_batch: int, profile: str | Path | None = None,
                    reprofile: bool | None = None, lookup: str | None = None) -> CostModel:
    """This setup's step-cost model for batches up to `max_batch`: from `profile` (or the cache), checked
    against the setup's fingerprint. The cache is re-measured when missing or mismatched; a profile file
    given explicitly that was measured on another setup is refused naming the field (reprofile None).
    lookup: how the table is read between profiled points (`CostModel.lookup`; None: the device's way)."""
    if reprofile is None:
        reprofile = profile is None
    from dspark.profiling import load_or_profile

    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
    batches = sorted(set(batches))
    cost = load_or_profile(target, drafter, getattr(drafter, "name", None), batches, path=profile, reprofile=reprofile)
    if lookup is not None:
        if lookup not in LOOKUPS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
        cost.lookup = lookup
    return cost


def encode_prompt(target: CausalLM, prompt: str, chat: bool = True) -> list[int]:
    """Tokenize a prompt, wrapped in the chat template as a user turn when `chat` is set."""
    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; pass token ids to dspark.decoding.decode instead")
    check_text("prompt", prompt)
    tok = target.tokenizer
    if chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return list(tok(text, add_special_tokens=False)["input_ids"])


def generate(
    target: CausalLM,
    drafter: Drafter,
    prompts: str | Sequence[str],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = True,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    scheduler: str = "fixed",
    cost_model: CostModel | None = None,
    profile: str | Path | None = None,
    workload: str | None = None,
) -> list[GenerationResult]:
    """Generate for one prompt or a batch; return per prompt the token ids, the text and per-round stats.

    Request i of a batch uses seed + i, so a batch is reproducible and its rows are independent.
    scheduler: how many drafts each request verifies per step ("fixed" verifies the whole block; see
    `dspark.scheduling`). "dspark" and "dspark-async" need this machine's step-cost profile: `cost_model`,
    or the profile file `profile`, or the cached profile of this setup (measured now when there is none).
    workload: a label (e.g. "math") whose survival calibration the adaptive schedulers use where the drafter's
    calibration has one.
    """
    if workload is not None:
        check_text("workload", workload)
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a string or a non-empty list of strings, got {prompts!r:.80}")
    check_int("max_new_tokens", max_new_tokens, 1)
    if seed is not None:
        check_int("seed", seed)  # its range: SamplingParams
    ids = [encode_prompt(target, check_text("prompt" if len(prompts) == 1 else f"prompts[{i}]", p), chat)
           for i, p in enumerate(prompts)]
    params = [
        SamplingParams(temperature, top_k, top_p, None if seed is None else seed + i) for i in range(len(ids))
    ]
    sched = Scheduler(scheduler, drafter_gamma(drafter))
    if sched.needs_cost and cost_model is None:
        cost_model = step_cost_model(target, drafter, len(ids), profile)
    results = decode(target, drafter, ids, params, max_new_tokens, on_tokens=on_tokens, scheduler=sched,
                     cost_model=cost_model, workloads=None if workload is None else [workload] * len(ids))
    for r in results:
        r.text = target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    return results
