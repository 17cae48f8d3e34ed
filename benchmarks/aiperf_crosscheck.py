"""Cross-check the sweep's load driver against NVIDIA's aiperf at one concurrency, and measure aiperf's own CPU.

    python benchmarks/aiperf_crosscheck.py [--aiperf /tmp/aiperf-venv/bin/aiperf] [--scheduler fixed]
        [--concurrency 8] [--duration 60] [--max-tokens 64] [--out benchmarks/results/serving]

aiperf's dependencies conflict with nothing here but are heavy, so it lives in its own environment:
`python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0` (do not set
HF_HUB_OFFLINE: aiperf 0.13.0 then refuses a local tokenizer folder). In plain `--concurrency` mode its
timing process polls without sleeping and takes a whole core (measured: 0.88–0.96 CPU-s per s at
concurrency 1–16 against a stand-in server), which on 2 cores would slow the server it measures; with
`--request-rate 1000 --arrival-pattern constant` beside `--concurrency` it stays closed-loop (a free slot
is refilled within 1 ms) at 0.2–0.4 CPU-s per s. This script uses those flags, samples the CPU time of
aiperf's process tree while it runs, then runs `serve_sweep.py`'s driver at the same concurrency against
the same server, and writes both figures side by side to OUT/aiperf_crosscheck.txt.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_sweep  # noqa: E402

from dspark.evaluation.bench import mixed_eval_prompts  # noqa: E402
from dspark.zoo import default_target_path  # noqa: E402


def tree_cpu_seconds(pid: int, seen: dict[int, float]) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc), cumulative: `seen` keeps
    each process's last reading, so a child that has exited still counts what it used."""
    stack, tick = [pid], os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            seen[p] = max(seen.get(p, 0.0), (int(fields[11]) + int(fields[12])) / tick)
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                stack += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return sum(seen.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    ap.add_argument("--scheduler", default="fixed")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--out", default="benchmarks/results/serving")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = mixed_eval_prompts(40)  # as serve_sweep.py takes them
    data = out / "aiperf_prompts.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))

    sweep_args = argparse.Namespace(drafter=args.drafter, port=args.port, concurrency=[args.concurrency],
                                    profile=None, start_timeout=900.0, max_tokens=args.max_tokens, ignore_eos=True,
                                    requests_per_client=max(3, int(args.duration * 2 / args.concurrency)))
    base = f"http://127.0.0.1:{args.port}"
    log = out / "aiperf_server.log"
    proc = serve_sweep.start_server(args.scheduler, args.port, sweep_args, log)
    try:
        serve_sweep.wait_healthy(proc, base, sweep_args.start_timeout, log, f"dspark serve --scheduler {args.scheduler}")
        model = serve_sweep.httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        cmd = [args.aiperf, "profile", "--model", model, "--tokenizer", str(default_target_path()), "--url", base,
               "--endpoint-type", "chat", "--streaming", "--use-legacy-max-tokens", "--concurrency",
               str(args.concurrency), "--request-rate", "1000", "--arrival-pattern", "constant",
               "--benchmark-duration", str(args.duration), "--benchmark-grace-period", "60",
               "--warmup-request-count", str(args.concurrency), "--osl", str(args.max_tokens),
               "--input-file", str(data), "--custom-dataset-type", "single_turn",
               "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--random-seed", "0", "--artifact-dir", str(out / "aiperf_run"), "--ui", "none",
               "--no-server-metrics", "--no-gpu-telemetry"]
        run = subprocess.Popen(cmd, env=env, stdout=(out / "aiperf_stdout.log").open("w"), stderr=subprocess.STDOUT)
        samples: list[tuple[float, float]] = []
        seen: dict[int, float] = {}

        def sample() -> None:
            while run.poll() is None:
                samples.append((time.time(), tree_cpu_seconds(run.pid, seen)))
                time.sleep(0.5)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        run.wait()
        watcher.join()
        if run.returncode != 0:
            raise RuntimeError(f"aiperf exited {run.returncode}; see {out / 'aiperf_stdout.log'}")
        summary = json.loads((out / "aiperf_run" / "profile_export_aiperf.json").read_text())
        # aiperf's CPU over the last `duration` seconds of its run (its start-up, ~10 CPU-s, comes before)
        end_t, end_c = samples[-1]
        mid = [s for s in samples if s[0] <= end_t - args.duration * 0.8]
        start_t, start_c = mid[-1] if mid else samples[0]
        aiperf_cpu = (end_c - start_c) / max(end_t - start_t, 1e-9)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        clients = asyncio.run(serve_sweep.closed_loop(base, model, prompts, args.concurrency, sweep_args, 0.0, 0))
        driver_cpu = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        ours = serve_sweep.cell_figures(clients)
    finally:
        serve_sweep.stop_server(proc)
    lines = [
        f"python benchmarks/aiperf_crosscheck.py {' '.join(sys.argv[1:])}",
        f"scheduler {args.scheduler}, drafter {args.drafter}, concurrency {args.concurrency}, "
        f"{args.max_tokens} tokens per request (ignore_eos), temperature 0",
        f"aiperf 0.13.0: output {summary['output_token_throughput']['avg']:.1f} tok/s, per-user p50 "
        f"{summary['output_token_throughput_per_user']['p50']:.1f} tok/s, TTFT p50 "
        f"{summary['time_to_first_token']['p50']:.0f} ms, requests {summary['request_count']['avg']:.0f}, "
        f"errors {summary.get('error_request_count', {}).get('avg', 0):.0f}; its own CPU {aiperf_cpu:.2f} CPU-s/s",
        f"serve_sweep driver: output {ours['throughput']:.1f} tok/s (steady window), per-user median "
        f"{ours['per_user_median']:.1f} tok/s, TTFT p50 {ours['ttft_p50'] * 1e3:.0f} ms, requests {ours['requests']}; "
        f"its own CPU {driver_cpu:.2f} CPU-s/s",
    ]
    text = "\n".join(lines)
    print(text)
    (out / "aiperf_crosscheck.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
