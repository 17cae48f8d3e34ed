"""Long schemathesis run against `dspark serve`'s own OpenAPI document (tests/test_fuzz_api.py on a short budget).

    python benchmarks/fuzz_api.py [--examples 1000] [--max-time SECONDS] [--seed 0] [--drafter dspark]
        [--phases examples,coverage,fuzzing]
        [--out benchmarks/results/hardening/fuzz_api.txt] [--port 8741]

Starts `dspark serve` (bundled target in float32, --scheduler fixed, default body limit of 1 MiB) on a local
port, then runs the schemathesis CLI on http://127.0.0.1:PORT/openapi.json with every check (no 5xx; statuses,
content types and bodies as documented, so every error an OpenAI error object; schema-valid data accepted and
schema-violating data rejected) plus tests/fuzz_hooks.py (its error_objects check; positive cases generate
at most 4 tokens), the examples, coverage (every boundary value of every field) and fuzzing phases, positive and
negative data, --examples cases per operation and mode in the fuzzing phase (with --max-time, fuzzing repeats
until the time is spent), a 60 s timeout per request (a hang fails the case). Prints and writes to --out: the
cases per operation, phase and mode with their statuses, the slowest requests, every failure schemathesis
reported (by check, with a reproducing curl), and schemathesis's own summary. Exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, limit: float = 300.0) -> None:
    """Poll /health until 200; fail if the server exits or `limit` seconds pass."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"dspark serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"dspark serve did not get healthy in {limit:.0f} s")


def table(log: Path) -> tuple[list[str], dict]:
    """Lines of the per-operation table from the FUZZ_API_LOG file; the raw counts."""
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    cases = collections.Counter((r["operation"], r["phase"], r["mode"]) for r in rows)
    statuses = collections.defaultdict(collections.Counter)
    for r in rows:
        statuses[(r["operation"], r["phase"], r["mode"])][r["status"]] += 1
    lines = [f"{'operation':<28} {'phase':<9} {'mode':<9} {'cases':>6}  statuses"]
    for key in sorted(cases):
        st = " ".join(f"{s}:{n}" for s, n in sorted(statuses[key].items()))
        lines.append(f"{key[0]:<28} {key[1]:<9} {key[2]:<9} {cases[key]:>6}  {st}")
    per_op = collections.Counter(r["operation"] for r in rows)
    lines.append("")
    lines.append("cases per operation: " + ", ".join(f"{op} {n}" for op, n in sorted(per_op.items()))
                 + f"; {len(rows)} in all")
    five = sum(1 for r in rows if r["status"] >= 500)
    lines.append(f"5xx answers: {five}")
    timed = sorted((r for r in rows if r["seconds"] is not None), key=lambda r: -r["seconds"])
    if timed:
        secs = sorted(r["seconds"] for r in timed)
        lines.append(f"request seconds: median {secs[len(secs) // 2]:.3f}, p99 {secs[int(0.99 * (len(secs) - 1))]:.3f}, "
                     f"max {secs[-1]:.3f} ({timed[0]['operation']} {timed[0]['phase']} {timed[0]['mode']} "
                     f"-> {timed[0]['status']})")
    return lines, {"cases": len(rows), "5xx": five}


def failures(report: dict) -> list[str]:
    """One block per failure in schemathesis's JSON report."""
    out = []
    for f in report.get("failures", []):
        out.append(json.dumps(f, indent=1)[:3000])
    for e in report.get("errors", []):
        out.append("ERROR " + json.dumps(e, indent=1)[:3000])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="fuzzing cases per operation (and mode)")
    ap.add_argument("--max-time", type=int, default=None, help="seconds for the whole run (fuzzing repeats)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="examples,coverage,fuzzing")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--port", type=int, default=8741)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/hardening/fuzz_api.txt"))
    args = ap.parse_args()
    if args.examples < 1 or (args.max_time is not None and args.max_time < 1):
        ap.error("--examples and --max-time must be positive")

    work = Path(tempfile.mkdtemp(prefix="fuzz_api_"))
    serve_log, calls, report_path, st_out = (work / n for n in ("serve.log", "calls.jsonl", "report.json", "st.txt"))
    base = f"http://127.0.0.1:{args.port}"
    serve_cmd = [sys.executable, "-m", "dspark.cli", "serve", "--drafter", args.drafter, "--scheduler", "fixed",
                 "--dtype", "float32", "--port", str(args.port), "--served-model-name", "target"]
    st_cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json", "--checks", "all",
              "--phases", args.phases, "--max-examples", str(args.examples), "--continue-on-failure",
              "--request-timeout", "60", "--suppress-health-check", "all", "--workers", "1", "--seed", str(args.seed),
              "--report", "json", "--report-json-path", str(report_path)]
    if args.max_time is not None:
        st_cmd += ["--max-time", str(args.max_time)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "FUZZ_API_LOG": str(calls), "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    with open(serve_log, "wb") as log:
        server = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_healthy(base, server, serve_log)
        start = time.perf_counter()
        with open(st_out, "w") as out:
            st = subprocess.run(st_cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work)
        seconds = time.perf_counter() - start
        alive = server.poll() is None and httpx.get(f"{base}/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    lines, counts = table(calls)
    st_text = st_out.read_text()
    at = st_text.find("SUMMARY")
    summary = st_text[st_text.rfind("\n", 0, at) + 1:] if at >= 0 else st_text[-4000:]
    failed = failures(report)
    tracebacks = serve_log.read_text().count("Traceback")
    head = [
        "schemathesis fuzzing of dspark serve's OpenAPI document (benchmarks/fuzz_api.py)",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S')}; schemathesis {report.get('schemathesis_version', '?')}; "
        f"{os.cpu_count()} CPUs",
        f"server: {' '.join(serve_cmd[1:])}",
        f"run: st {' '.join(st_cmd[3:])}",
        f"wall time of the run: {seconds:.0f} s; schemathesis exit code {st.returncode}; "
        f"server healthy afterwards: {alive}; tracebacks in the server log: {tracebacks}",
        f"test cases (schemathesis): {report.get('test_cases', {})}",
        "",
    ]
    text = "\n".join(head + lines + ["", f"failures: {len(failed)}"] + failed + ["", "schemathesis summary:", summary])
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(f"\nwrote {args.out} (raw logs in {work})")
    return 0 if st.returncode == 0 and not failed and counts["5xx"] == 0 and alive and not tracebacks else 1


if __name__ == "__main__":
    sys.exit(main())
