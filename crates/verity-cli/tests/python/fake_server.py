#!/usr/bin/env python3
"""A stdlib stub of the `verity serve` HTTP contract, for sanity-running test_server.py.

It is NOT a model: a "token" is a whitespace-prefixed word, the answers are
canned or pseudo-random words, and decoding is simulated with a short sleep
per token under one global engine lock (a serial engine, like a small CPU
server), so that cancellation on client disconnect is observable.

    python3 fake_server.py --port 8099 [--model smollm2-135m] [--no-optional]

--no-optional makes response_format json_* and tools answer 400
"unsupported_feature" (to exercise the tests' skip path). --fault NAME
(repeatable) injects a known contract violation, to check that the tests
notice it: %s.
"""

import argparse
import hashlib
import json
import random
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "smollm2-135m"
CONTEXT = 8192
MAX_BODY = 2 * 1024 * 1024
TOKEN_DELAY = 0.005
SUPPORT_OPTIONAL = True
FAULTS = set()
FAULT_NAMES = ("no-cancel", "no-done", "plain-405", "no-cache", "stream-diverge", "stop-leak",
               "bad-usage")

ENGINE = threading.Lock()
CACHE_LOCK = threading.Lock()
CACHE = []  # token sequences (prompt + completion) of finished requests
METRICS = {"requests": 0, "completion_tokens": 0, "ttft_sum": 0.0, "ttft_count": 0, "spec_cycles": 0}
METRICS_LOCK = threading.Lock()

WORDS = ("the of and a to in knight dragon sea wave castle fire sky gold brave old "
         "river stone night light wind tree song king road").split()


class ApiError(Exception):
    def __init__(self, status, message, kind="invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def tokenize(text):
    return re.findall(r"\s*\S+|\s+", text)


def render_chat(messages):
    parts = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"]
    for m in messages:
        parts.append("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m.get("content") or ""))
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- validation

def _num(body, key, lo, hi, lo_open=False):
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, "%s must be a number" % key, param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, "%s out of range" % key, param=key)
    return v


def _int(body, key, lo):
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, "%s must be an integer" % key, param=key)
    if v < lo:
        raise ApiError(400, "%s must be >= %d" % (key, lo), param=key)
    return v


def parse_common(body):
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if body.get("model") != MODEL:
        raise ApiError(404, "model %r not found" % body.get("model"), "model_not_found", "model")
    p = {
        "temperature": _num(body, "temperature", 0, 2),
        "top_p": _num(body, "top_p", 0, 1, lo_open=True),
        "min_p": _num(body, "min_p", 0, 1),
        "top_k": _int(body, "top_k", 0),
        "seed": _int(body, "seed", 0),
        "stream": bool(body.get("stream")),
        "include_usage": bool((body.get("stream_options") or {}).get("include_usage")),
    }
    if p["temperature"] is None:
        p["temperature"] = 1.0
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    mt = _int(body, "max_completion_tokens", 1)
    if mt is None:
        mt = _int(body, "max_tokens", 1)
    p["max_tokens"] = mt if mt is not None else 256
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    p["stop"] = stop
    spec = body.get("speculation", "auto")
    if spec not in ("off", "auto"):
        raise ApiError(400, "speculation must be 'off' or 'auto'", param="speculation")
    p["speculation"] = spec
    return p


def parse_chat(body):
    p = parse_common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, "invalid message role", param="messages")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise ApiError(400, "message content must be a string", param="messages")
    p["messages"] = msgs
    rf = body.get("response_format")
    p["json"] = None
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "unsupported response_format type", param="response_format")
        if kind != "text":
            if not SUPPORT_OPTIONAL:
                raise ApiError(400, "response_format is not supported yet", "unsupported_feature")
            p["json"] = kind
    p["tool"] = None
    if body.get("tools") is not None:
        if not SUPPORT_OPTIONAL:
            raise ApiError(400, "tools are not supported yet", "unsupported_feature")
        tc = body.get("tool_choice")
        if isinstance(tc, dict):
            p["tool"] = tc["function"]["name"]
    lp = body.get("logprobs")
    p["logprobs"] = bool(lp)
    p["top_logprobs"] = _int(body, "top_logprobs", 0) or 0
    p["prompt_tokens"] = tokenize(render_chat(msgs))
    return p


def parse_completion(body):
    p = parse_common(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    p.update(messages=[{"role": "user", "content": prompt}], json=None, tool=None,
             logprobs=False, top_logprobs=0, prompt_tokens=tokenize(prompt))
    return p


# ---------------------------------------------------------------- "model"

def candidate_tokens(p):
    """Every token the fake model would emit before EOS (None = no EOS)."""
    last = p["messages"][-1].get("content") or ""
    if p["tool"]:
        return tokenize('{"city": "Paris"}')
    if p["json"]:
        return tokenize('{"city": "Paris"}')
    if "capital of France" in last:
        return tokenize("The capital of France is Paris.")
    if last.startswith("The capital of France is"):
        return tokenize(" Paris, a city on the Seine.")
    if last.startswith("Count from 1"):
        return tokenize(", ".join(str(i) for i in range(1, 1001)))
    greedy = p["temperature"] == 0 or p["top_k"] == 1
    digest = hashlib.sha256("".join(p["prompt_tokens"]).encode()).hexdigest()
    if greedy:
        rng = random.Random(digest)
    else:
        rng = random.Random("%s/%s" % (digest, p["seed"]) if p["seed"] is not None else None)
    length = 3 if last.startswith(("Name ", "Say ")) else 400
    return [" " + rng.choice(WORDS) for _ in range(length)]


def run_generation(p, emit):
    """Decode under the engine lock; emit(token_text) returns False to cancel.

    Returns (tokens, finish_reason, cached_tokens, ttft).
    """
    prompt = p["prompt_tokens"]
    if len(prompt) + p["max_tokens"] > CONTEXT:
        raise ApiError(400, "prompt (%d tokens) + max_tokens (%d) exceeds context length %d"
                       % (len(prompt), p["max_tokens"], CONTEXT))
    with ENGINE:
        start = time.monotonic()
        with CACHE_LOCK:
            cached = max([lcp(prompt, s) for s in CACHE] + [0])
        cached = 0 if "no-cache" in FAULTS else min(cached, len(prompt) - 1)
        cand = candidate_tokens(p)
        out, text, finish, ttft = [], "", "stop", None
        for i, tok in enumerate(cand + [None]):
            if tok is None:
                finish = "stop"
                break
            if len(out) >= p["max_tokens"]:
                finish = "length"
                break
            time.sleep(TOKEN_DELAY)
            new_text = text + tok
            hit = [new_text.index(s) for s in p["stop"] if s in new_text]
            if hit and "stop-leak" not in FAULTS:
                cut = new_text[:min(hit)]
                if len(cut) > len(text) and not emit(cut[len(text):]):
                    return None
                text, finish = cut, "stop"
                out.append(tok)
                break
            out.append(tok)
            text = new_text
            if ttft is None:
                ttft = time.monotonic() - start
            if not emit(tok) and "no-cancel" not in FAULTS:
                return None  # client gone: stop decoding
        with CACHE_LOCK:
            CACHE.append(prompt + out)
    with METRICS_LOCK:
        METRICS["requests"] += 1
        METRICS["completion_tokens"] += len(out)
        METRICS["ttft_sum"] += ttft or 0.0
        METRICS["ttft_count"] += 1
    return out, text, finish, cached


def usage(p, n_out, cached):
    route = "ar" if p["speculation"] == "off" else "spec"
    cycles = 0 if route == "ar" else max(1, n_out // 2)
    with METRICS_LOCK:
        METRICS["spec_cycles"] += cycles
    return {
        "prompt_tokens": len(p["prompt_tokens"]) + (1 if "bad-usage" in FAULTS else 0),
        "completion_tokens": n_out,
        "total_tokens": len(p["prompt_tokens"]) + n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
        "verity": {"route": route, "cycles": cycles,
                   "accepted_per_cycle": (n_out / cycles) if cycles else 0.0,
                   "drafted": 2 * cycles, "accepted": min(n_out, 2 * cycles)},
    }


def logprobs_for(tokens):
    return {"content": [{"token": t, "logprob": -0.25, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": t, "logprob": -0.25, "bytes": list(t.encode())}]}
                        for t in tokens]}


# ---------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_obj(self, err):
        self.send_json(err.status, err.body())

    def do_GET(self):
        if self.path == "/health":
            return self.send_json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "verity"}]})
        if self.path == "/metrics":
            with METRICS_LOCK:
                m = dict(METRICS)
            text = ("# TYPE verity_requests_total counter\n"
                    "verity_requests_total{status=\"ok\"} %d\n"
                    "# TYPE verity_completion_tokens_total counter\n"
                    "verity_completion_tokens_total %d\n"
                    "# TYPE verity_ttft_seconds histogram\n"
                    "verity_ttft_seconds_bucket{le=\"+Inf\"} %d\n"
                    "verity_ttft_seconds_sum %f\n"
                    "verity_ttft_seconds_count %d\n"
                    "# TYPE verity_spec_cycles_total counter\n"
                    "verity_spec_cycles_total %d\n") % (
                m["requests"], m["completion_tokens"], m["ttft_count"], m["ttft_sum"],
                m["ttft_count"], m["spec_cycles"])
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.path in ("/v1/chat/completions", "/v1/completions", "/v1/cache/reset"):
            if "plain-405" in FAULTS:
                self.send_response(405)
                self.send_header("Content-Length", "0")
                return self.end_headers()
            return self.send_error_obj(ApiError(405, "method not allowed", "method_not_allowed"))
        self.send_error_obj(ApiError(404, "no such route", "not_found"))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            return self.send_error_obj(ApiError(413, "request body too large", "request_too_large"))
        raw = self.rfile.read(length)
        try:
            if self.path == "/v1/cache/reset":
                with CACHE_LOCK:
                    CACHE.clear()
                return self.send_json(200, {"status": "ok"})
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                raise ApiError(404, "no such route", "not_found")
            try:
                body = json.loads(raw)
            except ValueError:
                raise ApiError(400, "malformed JSON body")
            chat = self.path == "/v1/chat/completions"
            p = parse_chat(body) if chat else parse_completion(body)
            if p["stream"]:
                return self.stream(p, chat)
            result = run_generation(p, lambda _t: True)
            out, text, finish, cached = result
            self.send_json(200, self.full_response(p, chat, out, text, finish, cached))
        except ApiError as e:
            self.send_error_obj(e)

    def full_response(self, p, chat, out, text, finish, cached):
        base = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": MODEL,
                "usage": usage(p, len(out), cached)}
        if not chat:
            base.update(object="text_completion",
                        choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}])
            return base
        message = {"role": "assistant", "content": text}
        if p["tool"]:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_" + uuid.uuid4().hex[:8], "type": "function",
                "function": {"name": p["tool"], "arguments": text}}]}
            finish = "tool_calls"
        base.update(object="chat.completion", choices=[{
            "index": 0, "message": message, "finish_reason": finish,
            "logprobs": logprobs_for(out) if p["logprobs"] else None}])
        return base

    def stream(self, p, chat):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")  # as a real HTTP/1.1 server streams
        self.end_headers()
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def send(payload):
            if "stream-diverge" in FAULTS and '"content": "' in payload:
                payload = payload.replace('"content": "', '"content": "~', 1)
            data = ("data: %s\n\n" % payload).encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                return True
            except OSError:
                self.close_connection = True
                return False

        def finish():
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True

        def chunk(delta_or_text, finish=None):
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = delta_or_text
            else:
                choice["text"] = delta_or_text
            return json.dumps({"id": cid, "object": obj, "created": created, "model": MODEL,
                               "choices": [choice]})

        if chat and not send(chunk({"role": "assistant", "content": ""})):
            return
        try:
            result = run_generation(p, lambda t: send(chunk({"content": t} if chat else t)))
        except ApiError as e:
            send(json.dumps(e.body()))
            return finish()
        if result is None:
            return
        out, _, finish, cached = result
        send(chunk({} if chat else "", finish))
        if p["include_usage"]:
            send(json.dumps({"id": cid, "object": obj, "created": created, "model": MODEL,
                             "choices": [], "usage": usage(p, len(out), cached)}))
        if "no-done" not in FAULTS:
            send("[DONE]")
        finish()


def main():
    global MODEL, SUPPORT_OPTIONAL, TOKEN_DELAY, MAX_BODY
    ap = argparse.ArgumentParser(description="stub of verity serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8099)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--no-optional", action="store_true")
    ap.add_argument("--fault", action="append", default=[], choices=FAULT_NAMES)
    ap.add_argument("--token-delay", type=float, default=TOKEN_DELAY, help="seconds per token")
    ap.add_argument("--max-body", type=int, default=MAX_BODY, help="bytes before answering 413")
    args = ap.parse_args()
    MODEL, SUPPORT_OPTIONAL = args.model, not args.no_optional
    FAULTS.update(args.fault)
    TOKEN_DELAY, MAX_BODY = args.token_delay, args.max_body
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print("fake verity serve on http://%s:%d" % (args.host, args.port), flush=True)
    server.serve_forever()


__doc__ = __doc__ % ", ".join(FAULT_NAMES)

if __name__ == "__main__":
    main()
