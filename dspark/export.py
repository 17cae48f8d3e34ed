"""`dspark export`: write a drafter in the form vLLM serves, with its survival calibration beside it.

- Block drafters (DSpark, DFlash): vLLM `speculators` format, method `dspark` or `dflash`
  (`checkpoints.export_speculators`), which dspark also loads.
- EAGLE-3: speculators format, method `eagle3` (Qwen3 `transformer_layer_config`, full vocabulary, so no
  d2t/t2d maps; `norm_before_residual` false, as dspark's layer adds the raw hidden state back).
- Draft model: the plain Hugging Face causal LM and its tokenizer; vLLM runs it as a `draft_model`.
- n-gram: no weights; the `--speculative-config` that gives vLLM the same settings.

Every export has a README.md and `vllm_speculative_config.json` (the `--speculative-config` value for serving
it beside its verifier). speculators counts target layers as HF hidden-state indices (0 = the embedding
output), so its aux layer ids are dspark's `target_layer_ids` + 1. The export is built in a temporary folder
beside OUT and renamed into place, so a crash never leaves half of one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from safetensors.torch import save_file

from dspark.api import BUNDLED_DRAFTERS, CALIBRATION_FILE, calibration_path, load_drafter, load_target
from dspark.atomic import read_json
from dspark.checkpoints import export_speculators, shape_dict
from dspark.drafters.base import Drafter
from dspark.drafters.block import BlockDrafter
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.ngram import NgramDrafter
from dspark.identity import drafter_id
from dspark.target import CausalLM
from dspark.zoo import default_target_path

EXPORTABLE = ("ngram",) + BUNDLED_DRAFTERS
SPECULATORS_VERSION = "0.3.0"
SPEC_CONFIG_FILE = "vllm_speculative_config.json"


def export_drafter(drafter_name_or_path: str | Path, out: str | Path, target: str | Path | None = None,
                   verifier: str | None = None, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Export a bundled drafter (or a drafter checkpoint folder) for `target` into the new folder `out`.

    verifier: the verifier name or path the export names (default: the target folder). dtype: the stored
    weights' dtype. An existing non-empty `out` is replaced only with overwrite=True. Returns `out`.
    """
    name, out = str(drafter_name_or_path), Path(out)
    _check_drafter_arg(name)
    _check_out(out, overwrite)
    target_path = Path(target) if target is not None else default_target_path()
    lm = load_target(target_path, dtype)
    drafter = load_drafter(name, lm, calibration=None)
    _check_not_own_folder(out, drafter, target_path)
    verifier = verifier or str(target_path.resolve())
    with _staging(out, overwrite) as tmp:
        notes = _write_drafter(drafter, tmp, lm, verifier, out)
        notes["calibration"] = _copy_calibration(drafter, tmp, out.name)
        (tmp / "README.md").write_text(_readme(name, notes, verifier))
    return out


def _check_drafter_arg(name: str) -> None:
    if name == "none":
        raise ValueError("drafter 'none' drafts nothing, so there is nothing to export")
    if name not in EXPORTABLE and not Path(name).exists():
        raise ValueError(f"drafter: unknown drafter {name!r}; use one of {', '.join(EXPORTABLE)} "
                         f"or the path of a drafter checkpoint")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out: {out} exists and is not empty; pass overwrite=True (CLI: --force) to replace it")


def _check_not_own_folder(out: Path, drafter: Drafter, target_path: Path) -> None:
    source = getattr(drafter, "source_path", None)
    for what, folder in (("the drafter's own folder", source), ("the target's folder", target_path)):
        if folder is not None and out.resolve() == Path(folder).resolve():
            raise ValueError(f"out: {out} is {what}; export into another folder")


@contextmanager
def _staging(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """A temporary folder beside `out`; on success its files are synced and it is renamed to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        _check_out(out, overwrite)  # again: OUT may have been filled while the export was written
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(folder: Path) -> None:
    os.chmod(folder, 0o755)  # mkdtemp makes 0700; an export is an ordinary folder
    for path in folder.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)  # some writers (safetensors) make 0600 files
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp to out; a non-empty out is moved aside first and deleted once tmp is in place."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # rename(2) replaces an empty folder
    dir_fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_drafter(drafter: Drafter, tmp: Path, target: CausalLM, verifier: str, out: Path) -> dict:
    """Write the drafter's files into tmp; return notes for the README (kind, format, drafts per round)."""
    if isinstance(drafter, BlockDrafter):
        notes = _write_block(drafter, tmp, target, verifier)
    elif isinstance(drafter, Eagle3Drafter):
        notes = _write_eagle3(drafter, tmp, target, verifier)
    elif isinstance(drafter, DraftModelDrafter):
        notes = _write_draft_model(drafter, tmp)
    elif isinstance(drafter, NgramDrafter):
        notes = _write_ngram(drafter)
    else:
        raise ValueError(f"drafter: {type(drafter).__name__} has no export format")
    notes.setdefault("spec", _served_spec(notes, out))
    (tmp / SPEC_CONFIG_FILE).write_text(json.dumps(notes["spec"], indent=2) + "\n")
    return notes


def _served_spec(notes: dict, out: Path) -> dict:
    """`--speculative-config` serving the export beside its verifier (a speculators config names its method)."""
    spec = {"model": str(out.resolve()), "num_speculative_tokens": notes["k"]}
    return {"method": "draft_model", **spec} if notes["method"] == "draft_model" else spec


def _write_block(drafter: BlockDrafter, tmp: Path, target: CausalLM, verifier: str) -> dict:
    c = drafter.model.cfg
    export_speculators(drafter.model, tmp, target, verifier, SPECULATORS_VERSION)
    cfg = json.loads((tmp / "config.json").read_text())
    return {"kind": _block_kind(c), "method": cfg["speculators_model_type"], "k": c.num_drafts, "format": "speculators"}


def _block_kind(c) -> str:
    if c.markov_rank == 0 and not c.enable_confidence_head:
        return "DFlash block drafter"
    head = f"{c.markov_head_type} Markov head of rank {c.markov_rank}" if c.markov_rank else "no Markov head"
    conf = "a confidence head" if c.enable_confidence_head else "no confidence head"
    return f"DSpark block drafter ({head}, {conf})"


def _speculators_block(algorithm: str, tokens: int, verifier: str, target: CausalLM) -> dict:
    """The `speculators_config` entry: one greedy proposal method and the verifier."""
    arch = list(target.model.config.architectures or [type(target.model).__name__])
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": arch},
    }


def eagle3_speculators_config(drafter: Eagle3Drafter, target: CausalLM, verifier: str) -> dict:
    """config.json of an EAGLE-3 drafter in speculators format (method eagle3, Qwen3 layer, full vocabulary)."""
    c = drafter.cfg
    layer = {**shape_dict(c), "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
             "tie_word_embeddings": False}
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": _speculators_block("eagle3", drafter.gamma, verifier, target),
        "transformer_layer_config": layer,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": int(target.model.config.hidden_size),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "dtype": str(target.dtype).removeprefix("torch."),
    }


def _write_eagle3(drafter: Eagle3Drafter, tmp: Path, target: CausalLM, verifier: str) -> dict:
    """fc, layers.0.*, norm as trained, plus copies of the target's embed_tokens and lm_head."""
    weights = {k: v.detach().contiguous().clone() for k, v in drafter.model.state_dict().items()}
    for key, module in (("embed_tokens.weight", target.model.get_input_embeddings()),
                        ("lm_head.weight", target.model.get_output_embeddings())):
        weights[key] = module.weight.detach().to(target.dtype).contiguous().clone()
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = eagle3_speculators_config(drafter, target, verifier)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"kind": "EAGLE-3 drafter", "method": "eagle3", "k": drafter.gamma, "format": "speculators",
            "caveat": "The draft layer is a Qwen3 layer (q/k norms): vLLM must map a `qwen3` "
                      "transformer_layer_config to its Qwen3 EAGLE-3 drafter class; a vLLM whose speculators "
                      "loader uses the Llama EAGLE-3 layer for every eagle3 checkpoint would skip the q/k norms."}


def _write_draft_model(drafter: DraftModelDrafter, tmp: Path) -> dict:
    drafter.lm.model.save_pretrained(tmp)
    if drafter.lm.tokenizer is not None:
        drafter.lm.tokenizer.save_pretrained(tmp)
    return {"kind": "independent draft model", "method": "draft_model", "k": drafter.gamma, "format": "hf"}


def ngram_speculative_config(drafter: NgramDrafter) -> dict:
    """vLLM's `--speculative-config` for dspark's n-gram settings."""
    return {"method": "ngram", "num_speculative_tokens": drafter.gamma,
            "prompt_lookup_max": drafter.max_n, "prompt_lookup_min": drafter.min_n}


def _write_ngram(drafter: NgramDrafter) -> dict:
    return {"kind": "n-gram prompt lookup", "method": "ngram", "k": drafter.gamma, "format": "none",
            "spec": ngram_speculative_config(drafter)}


def _copy_calibration(drafter: Drafter, tmp: Path, final_name: str) -> str | None:
    """Copy the drafter's calibration.json into tmp. One fitted for this very drafter is re-keyed to the
    export's drafter id (dspark names a drafter by its folder), so dspark picks it up there too."""
    src = calibration_path(drafter)
    if src is None or not src.exists():
        return None
    data = read_json(src, "calibration file")
    if not isinstance(drafter, NgramDrafter) and data.get("drafter") == drafter_id(drafter):
        data["exported_from"] = data["drafter"]
        data["drafter"] = drafter_id(SimpleNamespace(name=final_name, source_path=tmp))
    (tmp / CALIBRATION_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return str(src)


def _serve_lines(notes: dict, verifier: str) -> list[str]:
    spec = json.dumps(notes["spec"])
    lines = [f"    vllm serve {verifier} --speculative-config '{spec}'"]
    if notes["format"] == "speculators":
        lines = ["    vllm serve <this folder>    # reads the verifier from speculators_config", "", "or", ""] + lines
    return lines


FORMAT_TEXT = {
    "speculators": "vLLM `speculators` format (config.json with `speculators_config`, model.safetensors). "
                   "dspark loads this folder as a drafter too (`dspark generate --drafter <this folder>`).",
    "hf": "A plain Hugging Face causal LM with its tokenizer (not a speculators checkpoint): vLLM runs it as an "
          "independent draft model (`\"method\": \"draft_model\"`). It must share the verifier's tokenizer.",
    "none": "No weights: vLLM's built-in n-gram (prompt lookup) proposer with dspark's settings. vLLM looks for "
            "the longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min) earlier in the "
            "context and proposes the tokens that followed it; where a suffix occurs more than once it may pick "
            "another occurrence than dspark, which takes the most recent one.",
}


def _readme(name: str, notes: dict, verifier: str) -> str:
    cal = notes["calibration"]
    cal_text = (f"`{CALIBRATION_FILE}` is dspark's survival calibration, copied from {cal} (vLLM does not read it)."
                if cal else "The drafter had no calibration.json, so none is copied.")
    lines = [
        f"# dspark export of the `{name}` drafter: {notes['kind']}, vLLM method `{notes['method']}`", "",
        FORMAT_TEXT[notes["format"]], "", *([notes["caveat"], ""] if "caveat" in notes else []),
        f"Drafts per round: {notes['k']}. Verifier: `{verifier}`.", "",
        "Serve with vLLM:", "", *_serve_lines(notes, verifier), "",
        f"`{SPEC_CONFIG_FILE}` holds that `--speculative-config` value. {cal_text}", "",
    ]
    return "\n".join(lines)
