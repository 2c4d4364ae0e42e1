#!/usr/bin/env python3
"""Bounded load test for `verity serve`.

N concurrent streaming chat clients run for a fixed duration. Each client loops:
send a chat request (prompts from bench/prompts.jsonl), stream the answer, record
success/error, TTFT (time to the first content delta), total latency and completion
tokens. While it runs, the server's RSS is sampled from /proc/PID/status every 5 s.
At the end a summary is printed (and written as JSON with --json).

No new request is started after --duration; requests already in flight are allowed
to finish (the "drain"), so every request sent is accounted for.

Exit status: 0 when every request either succeeded or was rejected with 503 and the
server's /health answers at the end; 1 otherwise; 2 on a setup failure.

Python 3.11, stdlib + `openai` (where `openai` cannot be imported — a machine without network to fetch it — the
requests go through `http.client`, one worker thread per client, with the same checks).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import openai
except ImportError:
    openai = None

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROMPTS = REPO / "bench" / "prompts.jsonl"
DEFAULT_VERITY = REPO / "target" / "release" / "verity"
METRIC_NAMES = (
    "verity_requests_total",
    "verity_completion_tokens_total",
    "verity_requests_cancelled_total",
    "verity_request_errors_total",
    "verity_requests_rejected_total",
)


# ---------------------------------------------------------------- server handling


class LaunchedServer:
    """`verity serve --port 0` started by this script; stopped with SIGINT (graceful)."""

    def __init__(self, verity: str, threads: int, queue: int, cache_dir: str | None, model: str | None,
                 batch: int | None = None):
        cmd = [verity, "--threads", str(threads), "serve", "--port", "0", "--queue", str(queue)]
        if batch:
            cmd += ["--batch", str(batch)]
        if model:
            cmd += ["--model", model]
        env = dict(os.environ)
        if cache_dir:
            env["VERITY_CACHE_DIR"] = cache_dir
        self.stderr_file = tempfile.NamedTemporaryFile(
            prefix="verity-serve-", suffix=".log", delete=False
        )
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.stderr_file,
            env=env,
            text=True,
        )
        self.base_url: str | None = None
        self._stdout_tail: list[str] = []

    def wait_listening(self, timeout: float = 120.0) -> str:
        found: dict[str, str] = {}
        ready = threading.Event()

        def reader() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:  # keeps draining after the address line
                line = line.rstrip("\n")
                self._stdout_tail = (self._stdout_tail + [line])[-50:]
                if "listening on " in line and "url" not in found:
                    found["url"] = line.split("listening on ", 1)[1].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=reader, daemon=True).start()
        if not ready.wait(timeout) or "url" not in found:
            self.stop()
            raise RuntimeError(
                f"server did not print its address (rc={self.proc.poll()}); "
                f"stderr: {self.stderr_tail()}"
            )
        self.base_url = found["url"]
        return self.base_url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.stderr_file.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        return self.proc.returncode


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def check_health(root: str) -> tuple[bool, str]:
    try:
        code, body = http_get(root + "/health")
    except Exception as e:  # noqa: BLE001 - any failure is a failed health check
        return False, f"{type(e).__name__}: {e}"
    ok = code == 200
    if ok:
        try:
            ok = json.loads(body).get("status") == "ok"
        except ValueError:
            ok = False
    return ok, f"{code} {body.strip()[:200]}"


def scrape_metrics(root: str) -> dict[str, float]:
    """The plain sample lines of /metrics (name → value), labels kept in the name."""
    _, text = http_get(root + "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def read_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """Samples VmRSS every `interval` seconds on its own thread (independent of the event loop)."""

    def __init__(self, pid: int, interval: float, t0: float):
        super().__init__(daemon=True)
        self.pid, self.interval, self.t0 = pid, interval, t0
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def sample(self) -> None:
        kib = read_rss_kib(self.pid)
        if kib is not None:
            self.samples.append((round(time.monotonic() - self.t0, 2), kib))

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=self.interval + 1)


# ---------------------------------------------------------------- clients


@dataclass
class Record:
    client: int
    prompt_id: str
    start_s: float  # since the test began
    status: str  # ok | error | rejected
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Shared:
    records: list[Record] = field(default_factory=list)


def judge(rec: Record, usage_tokens: int | None, content_chunks: int, max_tokens: int) -> None:
    """A finished stream's status: ok only with a finish_reason and a usage chunk within the token limit."""
    if rec.finish_reason is None:
        rec.error = "stream ended without a finish_reason"
    elif usage_tokens is None:
        rec.error = "no usage chunk despite stream_options.include_usage"
    elif usage_tokens > max_tokens:
        rec.error = f"usage.completion_tokens {usage_tokens} > max_tokens {max_tokens}"
    else:
        rec.status = "ok"
    rec.completion_tokens = usage_tokens if usage_tokens is not None else content_chunks


class StdlibClient:
    """Streaming chat requests over `http.client`, each blocking request on a worker thread of its own."""

    def __init__(self, base_url: str, timeout: float, workers: int):
        u = urllib.parse.urlsplit(base_url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.pool.shutdown(wait=True)

    async def request(self, model: str, prompt: dict, args, cid: int, t0: float) -> Record:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.blocking, model, prompt, args, cid, t0)

    def blocking(self, model: str, prompt: dict, args, cid: int, t0: float) -> Record:
        start = time.monotonic()
        rec = Record(client=cid, prompt_id=prompt["id"], start_s=round(start - t0, 3), status="error", latency_s=0.0)
        content_chunks, usage_tokens = 0, None
        body = json.dumps({"model": model, "messages": prompt["messages"], "max_tokens": args.max_tokens,
                           "temperature": args.temperature, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json", "Authorization": "Bearer verity-load-test"})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.status = "rejected" if resp.status == 503 else "error"
                rec.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            else:
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"]["completion_tokens"]
                    for ch in chunk.get("choices") or []:
                        if (ch.get("delta") or {}).get("content"):
                            if rec.ttft_s is None:
                                rec.ttft_s = time.monotonic() - start
                            content_chunks += 1
                        if ch.get("finish_reason") is not None:
                            rec.finish_reason = ch["finish_reason"]
                judge(rec, usage_tokens, content_chunks, args.max_tokens)
        except Exception as e:  # noqa: BLE001 - any exception is a failed request
            rec.error = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            conn.close()
        rec.latency_s = time.monotonic() - start
        return rec


def make_client(base_url: str, timeout: float, workers: int):
    """The `openai` client, or the stdlib one where the package is missing."""
    if openai is None:
        return StdlibClient(base_url, timeout, workers)
    return openai.AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key="verity-load-test",
        max_retries=0,  # a 503 must be seen, not silently retried
        timeout=timeout,
    )


async def one_request(client, model: str, prompt: dict, args, cid: int, t0: float) -> Record:
    if isinstance(client, StdlibClient):
        return await client.request(model, prompt, args, cid, t0)
    start = time.monotonic()
    rec = Record(client=cid, prompt_id=prompt["id"], start_s=round(start - t0, 3), status="error", latency_s=0.0)
    content_chunks = 0
    usage_tokens: int | None = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=prompt["messages"],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            for ch in chunk.choices:
                if ch.delta is not None and ch.delta.content:
                    if rec.ttft_s is None:
                        rec.ttft_s = time.monotonic() - start
                    content_chunks += 1
                if ch.finish_reason is not None:
                    rec.finish_reason = ch.finish_reason
        rec.latency_s = time.monotonic() - start
        judge(rec, usage_tokens, content_chunks, args.max_tokens)
    except openai.APIStatusError as e:
        rec.latency_s = time.monotonic() - start
        rec.status = "rejected" if e.status_code == 503 else "error"
        rec.error = f"HTTP {e.status_code}: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - any exception is a failed request
        rec.latency_s = time.monotonic() - start
        rec.error = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


async def client_loop(cid: int, client, model, prompts, args, t0, deadline, shared: Shared) -> None:
    i = 0
    while time.monotonic() < deadline:
        prompt = prompts[(cid + i) % len(prompts)]
        i += 1
        rec = await one_request(client, model, prompt, args, cid, t0)
        shared.records.append(rec)
        if rec.status == "rejected":
            await asyncio.sleep(args.reject_backoff)  # back off a little before retrying


async def warmup(args, base_url: str, model: str, prompts: list[dict]) -> list[Record]:
    """Requests sent one by one before the test so the model's pages are resident when RSS 'start' is read."""
    client = make_client(base_url, args.request_timeout, 1)
    t0 = time.monotonic()
    async with client:
        return [await one_request(client, model, prompts[i % len(prompts)], args, -1, t0) for i in range(args.warmup)]


async def run_clients(args, base_url: str, model: str, prompts: list[dict], t0: float) -> tuple[Shared, float]:
    client = make_client(base_url, args.request_timeout, args.clients)
    shared = Shared()
    deadline = time.monotonic() + args.duration
    async with client:
        await asyncio.gather(
            *(client_loop(c, client, model, prompts, args, t0, deadline, shared) for c in range(args.clients))
        )
    return shared, time.monotonic()


# ---------------------------------------------------------------- summary


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{p}": (None if (x := percentile(values, p)) is None else round(x, 3)) for p in (50, 90, 95, 99)}


def summarize(args, records: list[Record], wall_s: float, rss: list[tuple[float, int]], m0, m1) -> dict:
    ok = [r for r in records if r.status == "ok"]
    errors = [r for r in records if r.status == "error"]
    rejected = [r for r in records if r.status == "rejected"]
    tokens = sum(r.completion_tokens for r in ok)
    rss_mib = [kib / 1024 for _, kib in rss]
    rss_block = None
    if rss_mib:
        rss_block = {
            "start_mib": round(rss_mib[0], 1),
            "max_mib": round(max(rss_mib), 1),
            "end_mib": round(rss_mib[-1], 1),
            "growth_end_minus_start_mib": round(rss_mib[-1] - rss_mib[0], 1),
            "growth_max_minus_start_mib": round(max(rss_mib) - rss_mib[0], 1),
            "samples": len(rss_mib),
            "interval_s": args.rss_interval,
        }
        # After the first quarter of the run the model and buffers are warm: growth past it would be a leak.
        warm = [kib / 1024 for t, kib in rss if t >= args.duration / 4]
        if warm:
            rss_block["growth_after_warmup_mib"] = round(warm[-1] - warm[0], 1)
    metrics = {}
    for name in METRIC_NAMES:
        if name in m1:
            metrics[name] = {"end": m1[name], "delta": m1[name] - m0.get(name, 0.0)}
    error_kinds: dict[str, int] = {}
    for r in errors:
        key = (r.error or "?")[:120]
        error_kinds[key] = error_kinds.get(key, 0) + 1
    return {
        "config": {
            "clients": args.clients,
            "duration_s": args.duration,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "include_usage": True,
        },
        "wall_s": round(wall_s, 2),
        "requests": {"ok": len(ok), "errors": len(errors), "rejected": len(rejected), "total": len(records)},
        "error_kinds": error_kinds,
        "completion_tokens": tokens,
        "throughput_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "ttft_s": pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "latency_s": pcts([r.latency_s for r in ok]),
        "finish_reasons": {fr: sum(1 for r in ok if r.finish_reason == fr) for fr in sorted({r.finish_reason for r in ok})},
        "rss": rss_block,
        "server_metrics": metrics,
        "rss_samples": [{"t_s": t, "rss_mib": round(kib / 1024, 1)} for t, kib in rss],
        "records": [asdict(r) | {"latency_s": round(r.latency_s, 3), "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3)} for r in records],
    }


def fmt(x) -> str:
    return "-" if x is None else f"{x}"


def print_summary(s: dict) -> None:
    r = s["requests"]
    print(f"\n== verity load test: {s['config']['clients']} clients, {s['config']['duration_s']} s "
          f"(+ drain, wall {s['wall_s']} s), max_tokens {s['config']['max_tokens']}")
    print(f"requests   ok {r['ok']}  errors {r['errors']}  rejected(503) {r['rejected']}  total {r['total']}")
    for k, n in s["error_kinds"].items():
        print(f"  error x{n}: {k}")
    print(f"throughput {fmt(s['throughput_tok_s'])} completion tok/s ({s['completion_tokens']} tokens), "
          f"{fmt(s['requests_per_s'])} req/s")
    t, l = s["ttft_s"], s["latency_s"]
    print(f"TTFT s     p50 {fmt(t['p50'])}  p90 {fmt(t['p90'])}  p95 {fmt(t['p95'])}  p99 {fmt(t['p99'])}")
    print(f"latency s  p50 {fmt(l['p50'])}  p90 {fmt(l['p90'])}  p99 {fmt(l['p99'])}")
    if s["rss"]:
        m = s["rss"]
        print((f"RSS MiB    idle before warm-up {m['idle_before_warmup_mib']}\n" if "idle_before_warmup_mib" in m else "")
              + f"RSS MiB    start {m['start_mib']}  max {m['max_mib']}  end {m['end_mib']}  "
              f"growth end-start {m['growth_end_minus_start_mib']:+}  max-start {m['growth_max_minus_start_mib']:+}"
              + (f"  after-warmup {m['growth_after_warmup_mib']:+}" if "growth_after_warmup_mib" in m else "")
              + f"  ({m['samples']} samples)")
    else:
        print("RSS        not sampled (no --pid / --launch)")
    for name, v in s["server_metrics"].items():
        print(f"/metrics   {name} {v['end']:g} (this run +{v['delta']:g})")
    print(f"health     {s.get('health_end', '-')}")
    la = s.get("loadavg_1_5_15")
    if la:
        print(f"loadavg    start {la['start'][0]:.2f}  end {la['end'][0]:.2f} (1-min; 2 cores)")


# ---------------------------------------------------------------- main


def load_prompts(path: Path) -> list[dict]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f):
            if line.strip():
                p = json.loads(line)
                if "messages" not in p:  # multi-turn entries ("turns") are not single requests: skip
                    continue
                prompts.append({"id": p.get("id", f"p{n}"), "messages": p["messages"]})
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root (ignored with --launch)")
    ap.add_argument("--launch", action="store_true", help="start `verity serve` here and stop it at the end")
    ap.add_argument("--verity", default=str(DEFAULT_VERITY), help="verity binary for --launch")
    ap.add_argument("--threads", type=int, default=2, help="--threads for the launched server")
    ap.add_argument("--queue", type=int, default=64, help="--queue for the launched server")
    ap.add_argument("--batch", type=int, default=None, help="--batch for the launched server (default: its own)")
    ap.add_argument("--cache-dir", default=None, help="VERITY_CACHE_DIR for the launched server (default: inherited)")
    ap.add_argument("--model", default=None, help="--model for the launched server (default: its default)")
    ap.add_argument("--pid", type=int, default=None, help="server PID for RSS sampling (without --launch)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds during which new requests start")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--rss-interval", type=float, default=5.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--reject-backoff", type=float, default=0.5, help="seconds a client waits after a 503")
    ap.add_argument("--warmup", type=int, default=1,
                    help="requests sent (and not counted) before the test, so RSS 'start' is the warm steady state")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the summary (and per-request records) here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(Path(args.prompts))

    server: LaunchedServer | None = None
    pid = args.pid
    try:
        if args.launch:
            server = LaunchedServer(args.verity, args.threads, args.queue, args.cache_dir, args.model, args.batch)
            root = server.wait_listening()
            pid = server.pid
            print(f"launched: {' '.join(server.cmd)} (pid {pid}) at {root}", flush=True)
        else:
            root = args.base_url.rstrip("/")
            if root.endswith("/v1"):
                root = root[:-3]
        healthy, detail = check_health(root)
        if not healthy:
            print(f"server not healthy at start: {detail}", file=sys.stderr)
            return 2
        _, models = http_get(root + "/v1/models")
        model = json.loads(models)["data"][0]["id"]
        rss_idle = read_rss_kib(pid) if pid is not None else None
        if args.warmup > 0:
            print(f"warm-up: {args.warmup} request(s), not counted ...", flush=True)
            warm = asyncio.run(warmup(args, root, model, prompts))
            bad = [r for r in warm if r.status != "ok"]
            if bad:
                print(f"warm-up request failed: {bad[0].error}", file=sys.stderr)
                return 2
        m0 = scrape_metrics(root)
        load_start = os.getloadavg()

        t0 = time.monotonic()
        sampler = None
        if pid is not None:
            sampler = RssSampler(pid, args.rss_interval, t0)
            sampler.sample()  # RSS at start, before any request
            sampler.start()
        else:
            print("no --pid: RSS will not be sampled", file=sys.stderr)
        print(f"running {args.clients} clients for {args.duration:g} s against {root} (model {model}) ...", flush=True)

        shared, t_end = asyncio.run(run_clients(args, root, model, prompts, t0))
        wall = t_end - t0
        if sampler is not None:
            sampler.stop()
            sampler.sample()  # RSS at the end, after the drain

        m1 = scrape_metrics(root)
        healthy, detail = check_health(root)
        summary = summarize(args, shared.records, wall, sampler.samples if sampler else [], m0, m1)
        if summary["rss"] is not None and rss_idle is not None:
            summary["rss"]["idle_before_warmup_mib"] = round(rss_idle / 1024, 1)
        summary["loadavg_1_5_15"] = {"start": load_start, "end": os.getloadavg()}
        summary["health_end"] = ("ok " if healthy else "FAILED ") + detail
        summary["server"] = {"root": root, "model": model, "pid": pid, "launched": bool(server)}
        if server is not None:
            summary["server"]["cmd"] = server.cmd
        print_summary(summary)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
            print(f"wrote {args.json}")
        failed = summary["requests"]["errors"] > 0 or not healthy
        if failed:
            print("FAIL: " + ("non-503 errors; " if summary["requests"]["errors"] else "")
                  + ("health check failed" if not healthy else ""), file=sys.stderr)
        return 1 if failed else 0
    finally:
        if server is not None:
            rc = server.stop()
            print(f"server stopped (rc {rc}); its stderr: {server.stderr_file.name}")


if __name__ == "__main__":
    sys.exit(main())
