#!/usr/bin/env python3
"""`verity serve` against llama.cpp's own server under the same load, one client count at a time.

For each client count N, each server is started on the same GGUF with as many batch slots as clients
(`verity serve --batch N`, `llama-server -np N`, both with --threads/-t T), warmed up, and driven by
`load_test.py` (N streaming chat clients for --duration seconds, then the drain); then it is stopped and the
other runs. Prints completion throughput and TTFT p50/p95 per server and N, with the ratio, and writes every
run's summary (--json). The servers run one after the other, never at once.

    python3 bench/load/vs_llama_server.py --model M.gguf --llama-server PATH/llama-server \\
        --clients 1,4,16,32 --duration 40 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import load_test  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(root: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(root + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def start(arm: str, args, clients: int) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    if arm == "verity":
        device = ["--device", "cuda"] if args.gpu else []
        cmd = [args.verity, *device, "--threads", str(args.threads), "serve", "--model", args.model,
               "--port", str(port), "--batch", str(clients), "--queue", "64", *args.verity_flag]
    else:
        layers = ["-ngl", "999"] if args.gpu else []
        cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.threads), "-np", str(clients), "-c", str(clients * args.slot_context), *layers]
    log = tempfile.NamedTemporaryFile(prefix=f"{arm}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    wait_healthy(root, proc)
    return proc, root, cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF both servers load")
    ap.add_argument("--verity", default=str(load_test.DEFAULT_VERITY))
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--slot-context", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--gpu", action="store_true", help="both servers on the GPU (verity --device cuda, llama-server -ngl 999)")
    ap.add_argument("--verity-flag", action="append", default=[], help="an extra `verity serve` flag (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs = []
    for n in [int(c) for c in args.clients.split(",")]:
        row = {}
        for arm in ("verity", "llama-server"):
            proc, root, cmd = start(arm, args, n)
            out = Path(tempfile.mkdtemp()) / "run.json"
            try:
                rc = load_test.main([
                    "--base-url", root, "--pid", str(proc.pid), "--clients", str(n),
                    "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
                    "--temperature", str(args.temperature), "--json", str(out),
                ])
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            s = json.loads(out.read_text())
            s.pop("records", None)
            s["cmd"], s["exit"] = cmd, rc
            runs.append({"arm": arm, "clients": n, "summary": s})
            row[arm] = s
        v, l = row["verity"], row["llama-server"]
        print(f"\n## {n} clients: throughput verity {v['throughput_tok_s']} vs llama-server {l['throughput_tok_s']} "
              f"tok/s ({v['throughput_tok_s'] / l['throughput_tok_s']:.2f}x); TTFT p50 {v['ttft_s']['p50']} vs "
              f"{l['ttft_s']['p50']} s, p95 {v['ttft_s']['p95']} vs {l['ttft_s']['p95']} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    print("\n| clients | verity tok/s | llama-server tok/s | ratio | TTFT p50 verity / llama-server | p95 |")
    print("| ---: | ---: | ---: | ---: | --- | --- |")
    for n in sorted({r["clients"] for r in runs}):
        v = next(r["summary"] for r in runs if r["clients"] == n and r["arm"] == "verity")
        l = next(r["summary"] for r in runs if r["clients"] == n and r["arm"] == "llama-server")
        print(f"| {n} | {v['throughput_tok_s']} | {l['throughput_tok_s']} | "
              f"{v['throughput_tok_s'] / l['throughput_tok_s']:.2f} | {v['ttft_s']['p50']} / {l['ttft_s']['p50']} s "
              f"| {v['ttft_s']['p95']} / {l['ttft_s']['p95']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
