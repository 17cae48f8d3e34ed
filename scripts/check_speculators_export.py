"""Load every kind of `dspark export` with vLLM's own `speculators` package and report, per kind, what it
made of it (run by hand, not in CI: it installs speculators, whose transformers pin conflicts with ours).

    python scripts/check_speculators_export.py [--venv /tmp/spec-venv] [--out FILE]

(default FILE: benchmarks/results/export/speculators_check.txt)

1. Creates (or reuses) a virtual environment at --venv that sees this interpreter's packages and has
   `speculators` installed over them (so its own transformers version wins there).
2. Exports every bundled drafter kind with dspark, in this environment, into a temporary folder.
3. In the venv, for each export: `SpeculatorModelConfig.from_pretrained` (which config class, key fields),
   `SpeculatorModel.from_pretrained` (which also loads the verifier's embedding / LM head), and a comparison
   of every tensor in model.safetensors with the loaded model's parameter of that name. Exports that are not
   speculators checkpoints (draft model, n-gram) are tried the same way and the exact error is reported.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
KINDS = ("dspark", "dspark-rnn", "dflash", "eagle3", "draft-model", "ngram")

# Runs inside the venv: argv[1] = export folder. Prints one JSON object.
CHECKER = r'''
import json, sys, traceback
from pathlib import Path

path = Path(sys.argv[1])
report = {}

def err(e):
    return f"{type(e).__name__}: {e}".strip()

try:
    import speculators, transformers, torch
    from importlib.metadata import version
    report["versions"] = {"speculators": version("speculators"), "transformers": transformers.__version__,
                          "torch": torch.__version__}
    from speculators import SpeculatorModel, SpeculatorModelConfig
except Exception as e:
    print(json.dumps({"fatal": "cannot import speculators: " + err(e)}))
    sys.exit(0)

try:
    cfg = SpeculatorModelConfig.from_pretrained(str(path))
    fields = {}
    for key in ("speculators_model_type", "draft_vocab_size", "block_size", "mask_token_id", "sample_from_anchor",
                "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                "target_hidden_size"):
        if hasattr(cfg, key):
            fields[key] = getattr(cfg, key)
    layer = cfg.transformer_layer_config
    fields["transformer_layer_config"] = {
        "class": type(layer).__name__, "hidden_size": layer.hidden_size,
        "num_hidden_layers": layer.num_hidden_layers, "head_dim": getattr(layer, "head_dim", None),
        "rope_parameters": getattr(layer, "rope_parameters", None)}
    sc = cfg.speculators_config
    fields["speculators_config"] = {"algorithm": sc.algorithm, "verifier": sc.verifier.name_or_path,
                                    "speculative_tokens": [p.speculative_tokens for p in sc.proposal_methods]}
    report["config"] = {"ok": True, "class": type(cfg).__name__, "fields": fields}
except Exception as e:
    report["config"] = {"ok": False, "error": err(e), "trace": traceback.format_exc(limit=3)}

if report["config"]["ok"]:
    try:
        model = SpeculatorModel.from_pretrained(str(path))
        state = model.state_dict()
        from safetensors import safe_open
        same, differ, absent = 0, [], []
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if name not in state:
                    absent.append(name)
                    continue
                t = f.get_tensor(name)
                p = state[name]
                if tuple(t.shape) != tuple(p.shape) or not torch.equal(t.to(p.dtype), p):
                    differ.append(f"{name} file {tuple(t.shape)} model {tuple(p.shape)}")
                else:
                    same += 1
        extra = sorted(k for k in state if k not in names)
        nan = sorted(k for k in extra if state[k].is_floating_point() and bool(torch.isnan(state[k]).any()))
        report["model"] = {"ok": not differ and not absent and not nan, "class": type(model).__name__,
                           "file_tensors": len(names), "identical": same, "differ": differ,
                           "file_tensors_not_in_model": absent, "model_tensors_not_in_file": extra,
                           "not_in_file_and_still_nan": nan}
    except Exception as e:
        report["model"] = {"ok": False, "error": err(e), "trace": traceback.format_exc(limit=4)}

probe = path.parent / (path.name + ".probe.safetensors")
if probe.exists() and report.get("model", {}).get("ok"):
    try:
        from safetensors.torch import load_file
        data = load_file(str(probe))
        model.config.transformer_layer_config._attn_implementation = "eager"
        ids, feats, want = data["ids"], data["features"].to(model.fc.weight.dtype), data["logits"]
        n = ids.shape[1]
        pos = torch.arange(n).unsqueeze(0)
        mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n).to(feats.dtype)
        with torch.no_grad():
            x = torch.cat([model.embed_tokens(ids), model.fc(feats)], -1)
            rope = model.rotary_emb(x, pos)
            out = model.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
            got = model.lm_head(model.norm(out)).float()
        report["probe"] = {"positions": n, "max_abs_logit_diff": float((got - want).abs().max()),
                           "logit_scale": float(want.abs().max()),
                           "argmax_agree": int((got.argmax(-1) == want.argmax(-1)).sum())}
    except Exception as e:
        report["probe"] = {"error": err(e), "trace": traceback.format_exc(limit=4)}

if (path / "config.json").exists() and not report["config"]["ok"]:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        lm = AutoModelForCausalLM.from_pretrained(str(path))
        tok = AutoTokenizer.from_pretrained(str(path))
        report["transformers"] = {"ok": True, "class": type(lm).__name__,
                                  "parameters": sum(p.numel() for p in lm.parameters()), "vocab": len(tok)}
    except Exception as e:
        report["transformers"] = {"ok": False, "error": err(e)}
spec = path / "vllm_speculative_config.json"
report["vllm_speculative_config"] = json.loads(spec.read_text()) if spec.exists() else None
print(json.dumps(report, default=str))
'''


IMPORT_CHECK = "from speculators import SpeculatorModel, SpeculatorModelConfig; import speculators.models"


def _imports(python: Path) -> bool:
    return python.exists() and subprocess.run([str(python), "-c", IMPORT_CHECK], capture_output=True).returncode == 0


def ensure_venv(venv: Path) -> Path:
    """Return the venv's python, creating the venv and installing speculators there when needed.

    The venv sees this interpreter's packages, and torch is pinned to ours so pip does not fetch another
    build; the torchvision / torchaudio wheels pip then picks (speculators' unused dependencies) are GPU
    builds that break `import transformers` against a CPU torch, so they are removed again."""
    python = venv / "bin" / "python"
    if _imports(python):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "speculators"]
    if subprocess.run(pip + [f"torch=={torch.__version__.split('+')[0]}"]).returncode == 0:
        if not _imports(python):
            subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
    else:  # no speculators release for our torch: let pip pick a torch for the venv
        subprocess.run(pip, check=True)
    if not _imports(python):
        raise SystemExit(f"speculators does not import in {venv}; see `{python} -c '{IMPORT_CHECK}'`")
    return python


def export_all(folder: Path) -> dict[str, str]:
    """Export every kind with dspark (bfloat16, the default), plus a float32 EAGLE-3 export with a probe
    file of dspark's own logits; return kind -> folder, or kind -> 'ERROR ...'."""
    from dspark.export import export_drafter

    done = {}
    for kind, dtype in [(k, "bfloat16") for k in KINDS] + [("eagle3-float32", "float32")]:
        try:
            done[kind] = str(export_drafter(kind.removesuffix("-float32"), folder / kind, dtype=dtype))
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            done[kind] = f"ERROR {type(e).__name__}: {e}"
    if not done["eagle3-float32"].startswith("ERROR"):
        eagle3_probe(Path(done["eagle3-float32"]))
    return done


@torch.no_grad()
def eagle3_probe(folder: Path, positions: int = 9) -> None:
    """dspark's EAGLE-3 logits for random target features and tokens, computed from the export as dspark
    loads it (one causal pass, as the drafter feeds committed pairs), saved beside the folder."""
    from safetensors.torch import save_file

    from dspark.api import load_drafter, load_target

    target = load_target(None, "float32")
    drafter = load_drafter(str(folder), target, calibration=None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, positions), generator=g)
    feats = torch.randn(1, positions, drafter.model.fc.in_features, generator=g)
    layer = drafter.model.layers[0]
    hidden = drafter.model.project(feats)
    x = layer.inputs(drafter.embed(ids), hidden)
    q, k, v = layer.self_attn.qkv(x, torch.arange(positions).unsqueeze(0))
    causal = torch.ones(positions, positions, dtype=torch.bool).tril().unsqueeze(0)
    out = layer.finish(hidden, layer.self_attn.attend(q, k, v, causal))
    logits = drafter.lm_head(drafter.model.norm(out)).float()
    probe = folder.parent / f"{folder.name}.probe.safetensors"
    save_file({"ids": ids, "features": feats, "logits": logits}, str(probe))


NOT_SPECULATORS = {
    "draft-model": "expected: a draft-model export is a plain HF causal LM, which vLLM loads itself "
                   "(method draft_model); speculators has no class for it",
    "ngram": "expected: an n-gram export has no weights and no config.json; n-gram lookup is built into vLLM "
             "(method ngram) and speculators has no n-gram method",
}

HEADER = """\
What was checked, per export (all made by `dspark export` from the bundled zoo; bfloat16 unless named):
- config: speculators' SpeculatorModelConfig.from_pretrained, i.e. the config class speculators picks and
  the fields it read back;
- model: SpeculatorModel.from_pretrained (which also loads the verifier's embedding and LM head from the
  verifier path named in the export), then every tensor of model.safetensors compared with the loaded model's
  parameter of the same name (shape and value);
- eagle3-float32 only: speculators' own EAGLE-3 modules (fc, first layer, norm, LM head; eager causal
  attention) run on random target features and tokens, against the logits dspark computes from the same
  export. The DSpark/DFlash block models are checked by name, shape and value only: speculators' block
  forward is a training pass and was not run.
vLLM itself was not run here; what it does with these configs was read from its source
(vllm/transformers_utils/configs/speculators/algos.py), not tested:
- dflash / dspark: vLLM sets the drafter's target_layer_ids to aux_hidden_state_layer_ids - 1, and EAGLE-3
  passes eagle_aux_hidden_state_layer_ids as hidden-state indices (0 = embedding output). dspark's own
  target_layer_ids count decoder layers (dspark reads hidden_states[i + 1]), so the export writes aux ids =
  target_layer_ids + 1 (the aux ids above: 2, 4, 6, 8, 10 for dspark's 1, 3, 5, 7, 9).
- eagle3: a qwen3 transformer_layer_config maps to vLLM's Qwen3 EAGLE-3 drafter (q/k norms), and
  norm_before_residual defaults to true when absent, so the export writes it as false explicitly.
"""


def verdict(kind: str, rep: dict) -> str:
    """One line: what speculators made of the export."""
    if "fatal" in rep:
        return rep["fatal"]
    cfg, model = rep["config"], rep.get("model")
    if cfg["ok"] and model and model["ok"]:
        return _loaded(cfg, model, rep.get("probe"))
    if cfg["ok"] and model:
        return f"config loads as {cfg['class']} but the model does not: {model.get('error') or model}"
    text = f"NOT loadable by speculators: {cfg['error']}"
    tf = rep.get("transformers")
    if tf is not None:
        text += f"; transformers {'loads it as ' + tf['class'] if tf['ok'] else 'fails too: ' + tf['error']}"
    return text + (f" ({NOT_SPECULATORS[kind]})" if kind in NOT_SPECULATORS else "")


def _loaded(cfg: dict, model: dict, probe: dict | None) -> str:
    text = f"LOADED by speculators as {model['class']} ({cfg['class']}); all {model['identical']} tensors identical"
    if probe and "error" in probe:
        return text + f"; logits probe failed: {probe['error']}"
    if probe:
        text += (f"; its logits match dspark's to {probe['max_abs_logit_diff']:.2e} (|logit| up to "
                 f"{probe['logit_scale']:.1f}), argmax equal at {probe['argmax_agree']}/{probe['positions']} positions")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default="/tmp/spec-venv")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/export/speculators_check.txt"))
    args = parser.parse_args()
    python = ensure_venv(Path(args.venv))
    with tempfile.TemporaryDirectory() as tmp:
        exports = export_all(Path(tmp))
        checker = Path(tmp) / "checker.py"
        checker.write_text(CHECKER)
        results = {kind: check_one(python, checker, folder) for kind, folder in exports.items()}
    versions = next((r["versions"] for r, _ in results.values() if "versions" in r), {})
    lines = [f"dspark export -> vLLM speculators check ({time.strftime('%Y-%m-%d')}; venv: "
             + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")", "", HEADER, "Summary:"]
    lines += [f"- {kind}: {verdict(kind, rep)}" for kind, (rep, _) in results.items()]
    lines += ["", "Details:"]
    for kind, (rep, files) in results.items():
        rep = {k: v for k, v in rep.items() if k != "versions"}
        lines += ["", f"== {kind}", f"files: {', '.join(files)}", json.dumps(rep, indent=1, default=str)]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def check_one(python: Path, checker: Path, folder: str) -> tuple[dict, list[str]]:
    """The checker's report on one export folder (or why there is none) and the folder's files."""
    if folder.startswith("ERROR"):
        return {"fatal": f"dspark export failed: {folder}"}, []
    run = subprocess.run([str(python), str(checker), folder], capture_output=True, text=True)
    try:
        rep = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        rep = {"fatal": f"checker crashed (exit {run.returncode}): {run.stderr.strip()[-2000:]}"}
    return rep, sorted(p.name for p in Path(folder).iterdir())


if __name__ == "__main__":
    sys.exit(main())
