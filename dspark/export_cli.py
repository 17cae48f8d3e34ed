"""`dspark export DRAFTER OUT`: write a drafter in the form vLLM serves (see dspark.export)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `export` subcommand to the `dspark` parser's subparsers; return it."""
    from dspark.export import EXPORTABLE

    e = subparsers.add_parser(
        "export", help="write a drafter for vLLM: speculators format (DSpark, DFlash, EAGLE-3), an HF draft model, "
                       "or the n-gram --speculative-config; calibration.json is copied beside it")
    e.add_argument("drafter", help=f"{' | '.join(EXPORTABLE)} | PATH of a drafter checkpoint")
    e.add_argument("out", help="folder to create (must be absent or empty unless --force)")
    e.add_argument("--target", default=None, help="target model folder (default: the bundled target)")
    e.add_argument("--verifier", default=None,
                   help="verifier name or path written into the export for vLLM (default: the target folder)")
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the stored weights (default: bfloat16)")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    e.set_defaults(func=cmd_export)
    return e


def cmd_export(args: argparse.Namespace) -> int:
    """Run `dspark export`; print where the export went and what it holds."""
    from dspark.export import export_drafter

    out = export_drafter(args.drafter, args.out, target=args.target, verifier=args.verifier, dtype=args.dtype,
                         overwrite=args.force)
    files = ", ".join(sorted(p.name for p in Path(out).iterdir()))
    print(f"exported {args.drafter} to {out}: {files} (README.md says how vLLM serves it)")
    return 0
