#!/usr/bin/env python3
"""End-to-end tests for `verity serve`, the OpenAI-compatible HTTP server.

Usage (normally launched by a Rust integration test against a live server):

    python3 crates/verity-cli/tests/python/test_server.py \
        --base-url http://127.0.0.1:PORT --model smollm2-135m [--api-key KEY] [unittest args, e.g. -k stream]

The server is driven with the official `openai` Python client and with raw
HTTP (`http.client`, stdlib); nothing else outside the stdlib is required.
Each test prints its name and result; the exit status is 0 only when every
test passed (skips allowed). A watchdog (--deadline) hard-fails a hung run.

Covered (the contract of `verity serve`):
  * GET /health -> {"status": "ok"}; GET /v1/models (raw and client.models.list()).
  * POST /v1/chat/completions, non-streaming: full ChatCompletion schema, usage
    incl. prompt_tokens_details.cached_tokens and the `usage.verity` extension.
  * Greedy known answer ("capital of Japan" -> "Tokyo"). (Not France: with 8-bit activations, the default
    numerics, SmolLM2-135M answers that one with a list of French words, exactly as llama.cpp does.)
  * Streaming (client and raw SSE): chunk schema, role in first delta,
    concatenated deltas == non-streaming greedy text, final finish_reason,
    `data: [DONE]`, and stream_options.include_usage (usage chunk, empty choices).
  * Sampling: temperature/top_p/top_k/min_p/seed accepted; same seed at
    temperature 0.8 reproduces the text; top_k=1 reproduces greedy text;
    max_tokens and max_completion_tokens (finish_reason "length", exact count);
    stop as string and list; n != 1 -> 400.
  * logprobs=True, top_logprobs=1: one entry per completion token.
  * `speculation` extension: "off" and "auto" give identical greedy text,
    route "ar" for "off".
  * Prefix cache: multi-turn reuse (cached_tokens > 0), POST /v1/cache/reset.
  * POST /v1/completions (legacy), non-streaming and streaming.
  * GET /metrics: Prometheus text with the required verity_* series, counters move, the gauges of active
    generations, K/V bytes and prefix-cache checkpoints.
  * Structured output: response_format json_object and json_schema (llguidance
    grammar; streamed too), tools with tool_choice auto, required and a named
    function (grammar-forced calls parsed into `tool_calls`, finish_reason
    "tool_calls", streamed as a tool_calls delta), a tool round trip (assistant
    tool_calls + tool results in the history), reasoning switches
    (chat_template_kwargs.enable_thinking, reasoning_effort) accepted.
  * Cancellation: a dropped streaming connection stops generation.
  * Concurrency: 4 simultaneous requests all succeed.
  * Bad input (raw HTTP): 4xx with an OpenAI-style error body for malformed
    JSON, wrong shapes/types/ranges, unknown model, n=3, bad stop and
    response_format, malformed tools / tool_choice / json_schema / template
    kwargs, top_logprobs without logprobs or out of range, wrong method (405),
    a 10 MB body (413/400); the server stays healthy after each.
  * Access: with --api-key, the client with a wrong key gets AuthenticationError
    (401); a text/plain POST is refused (415), a foreign Origin (403) and a
    foreign Host (421), each with an OpenAI-style error body.
Not covered here: queue-full behaviour (tested from Rust).
"""

import argparse
import http.client
import io
import json
import os
import re
import select
import socket
import sys
import threading
import time
import unittest
import urllib.parse
import uuid

try:
    import openai
except ImportError:  # pragma: no cover - environment problem, not a test failure mode
    sys.stderr.write("test_server.py needs the `openai` package: pip install openai\n")
    sys.exit(2)


# --------------------------------------------------------------------------
# Configuration (filled in by main() from argv)
# --------------------------------------------------------------------------

class Config:
    base_url = "http://127.0.0.1:8080"  # without the /v1 suffix
    host = "127.0.0.1"
    port = 8080
    model = "smollm2-135m"
    api_key = None  # the server's --api-key, sent by every request when set
    request_timeout = 60.0


CFG = Config()

# Prompts used across tests. Greedy decoding of CAPITAL is expected to mention Tokyo.
CAPITAL = [{"role": "user", "content": "What is the capital of Japan?"}]
CAPITAL_MAX_TOKENS = 32
# A prompt whose answer is long, so small token limits are always hit.
STORY = [{"role": "user", "content": "Write a long story about a brave knight and a dragon."}]

FINISH_REASONS = ("stop", "length")


# --------------------------------------------------------------------------
# Raw HTTP helpers (stdlib only)
# --------------------------------------------------------------------------

class HttpResult:
    """A fully-read HTTP response."""

    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # dict with lower-cased names
        self.body = body  # bytes

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def text(self):
        return self.body.decode("utf-8", errors="replace")

    def __repr__(self):
        snippet = self.body[:300].decode("utf-8", errors="replace")
        return "HttpResult(status=%d, body=%r)" % (self.status, snippet)


def auth_headers():
    return {"Authorization": "Bearer %s" % CFG.api_key} if CFG.api_key else {}


def _headers_of(resp):
    return {k.lower(): v for k, v in resp.getheaders()}


def http_request(method, path, body=None, headers=None, timeout=None):
    """Send one request on a fresh connection and read the whole response."""
    conn = http.client.HTTPConnection(CFG.host, CFG.port, timeout=timeout or CFG.request_timeout)
    try:
        hdrs = {"Accept": "application/json"}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        hdrs.update(auth_headers())
        hdrs.update(headers or {})
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return HttpResult(resp.status, _headers_of(resp), resp.read())
    finally:
        conn.close()


def post_json(path, obj, timeout=None):
    return http_request("POST", path, json.dumps(obj).encode("utf-8"), timeout=timeout)


def iter_sse_data(resp):
    """Yield the `data:` payloads of a text/event-stream response, in order.

    Follows the SSE rules that matter here: events end at a blank line,
    `:` lines are comments, an optional single space follows `data:`, and
    several data lines of one event are joined with newlines.
    """
    data_lines = []
    while True:
        raw = resp.readline()
        if not raw:
            break
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data_lines:
                yield "\n".join(data_lines)
                data_lines = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data_lines.append(value)
    if data_lines:
        yield "\n".join(data_lines)


def stream_raw(path, payload, timeout=None):
    """POST a streaming request; return (status, headers, [data payload strings])."""
    conn = http.client.HTTPConnection(CFG.host, CFG.port, timeout=timeout or CFG.request_timeout)
    try:
        conn.request("POST", path, body=json.dumps(payload).encode("utf-8"),
                     headers=dict(auth_headers(), **{"Content-Type": "application/json",
                                                     "Accept": "text/event-stream"}))
        resp = conn.getresponse()
        headers = _headers_of(resp)
        if resp.status != 200:
            return resp.status, headers, [resp.read().decode("utf-8", errors="replace")]
        return resp.status, headers, list(iter_sse_data(resp))
    finally:
        conn.close()


class _BytesSocket:
    """Lets http.client.HTTPResponse parse a response already held in memory."""

    def __init__(self, data):
        self._data = data

    def makefile(self, *args, **kwargs):
        return io.BytesIO(self._data)


def send_oversized(path, body, timeout=30.0):
    """POST a huge body, stopping early if the server answers before reading it all.

    A server may reply 413 as soon as it sees Content-Length and close the
    connection; we watch for readable data between chunks, then read whatever
    response arrived (even if the connection is reset afterwards).
    """
    sock = socket.create_connection((CFG.host, CFG.port), timeout=timeout)
    received = b""
    try:
        auth = "".join("%s: %s\r\n" % kv for kv in auth_headers().items())
        head = ("POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%s"
                "Content-Length: %d\r\nConnection: close\r\n\r\n"
                % (path, CFG.host, CFG.port, auth, len(body))).encode("ascii")
        sock.sendall(head)
        view = memoryview(body)
        offset = 0
        while offset < len(body):
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                offset += sock.send(view[offset:offset + 65536])
            except (BrokenPipeError, ConnectionResetError):
                break
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            received += chunk
            if _complete_http_response(received):
                break
    finally:
        sock.close()
    if not received:
        raise AssertionError("server sent no response to a %d-byte body (connection dropped)"
                             % len(body))
    resp = http.client.HTTPResponse(_BytesSocket(received), method="POST")
    resp.begin()
    try:
        payload = resp.read()
    except http.client.IncompleteRead as e:
        payload = e.partial
    return HttpResult(resp.status, _headers_of(resp), payload)


def _complete_http_response(data):
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    m = re.search(rb"(?im)^content-length:\s*(\d+)", data[:head_end])
    if m:
        return len(data) - head_end - 4 >= int(m.group(1))
    return data.endswith(b"0\r\n\r\n")  # chunked terminator; otherwise wait for EOF


# --------------------------------------------------------------------------
# openai client helpers
# --------------------------------------------------------------------------

_client = None


def client():
    global _client
    if _client is None:
        _client = openai.OpenAI(base_url=CFG.base_url + "/v1", api_key=CFG.api_key or "unused",
                                max_retries=0, timeout=CFG.request_timeout)
    return _client


def chat(**kwargs):
    """Non-streaming chat completion through the client: (parsed object, raw JSON dict)."""
    kwargs.setdefault("model", CFG.model)
    raw = client().chat.completions.with_raw_response.create(**kwargs)
    return raw.parse(), json.loads(raw.text)


_memo = {}


def capital_greedy():
    """The non-streaming greedy answer to CAPITAL (computed once, shared by tests)."""
    if "capital" not in _memo:
        _memo["capital"] = chat(messages=CAPITAL, temperature=0, max_tokens=CAPITAL_MAX_TOKENS)
    return _memo["capital"]


def error_of(exc):
    """The OpenAI-style `error` object carried by an openai.APIStatusError (or {})."""
    body = getattr(exc, "body", None)
    if not isinstance(body, dict):
        return {}
    # The client already unwraps {"error": {...}}; unwrap again defensively.
    return body["error"] if isinstance(body.get("error"), dict) else body


# --------------------------------------------------------------------------
# Assertions shared by several tests
# --------------------------------------------------------------------------

def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class ServerTestCase(unittest.TestCase):
    maxDiff = 2000

    # -- schema checks ----------------------------------------------------

    def assert_usage(self, usage, where="usage"):
        self.assertIsInstance(usage, dict, where)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            self.assertTrue(is_int(usage.get(key)), "%s.%s must be an int: %r" % (where, key, usage))
            self.assertGreaterEqual(usage[key], 0)
        self.assertEqual(usage["total_tokens"], usage["prompt_tokens"] + usage["completion_tokens"],
                         "%s: total_tokens != prompt_tokens + completion_tokens" % where)
        self.assertGreater(usage["prompt_tokens"], 0, where)

    def assert_chat_usage(self, usage):
        self.assert_usage(usage)
        details = usage.get("prompt_tokens_details")
        self.assertIsInstance(details, dict, "usage.prompt_tokens_details missing: %r" % usage)
        self.assertTrue(is_int(details.get("cached_tokens")), "cached_tokens must be an int")
        self.assertGreaterEqual(details["cached_tokens"], 0)
        self.assertLessEqual(details["cached_tokens"], usage["prompt_tokens"])
        ext = usage.get("verity")
        self.assertIsInstance(ext, dict, "usage.verity extension missing: %r" % usage)
        self.assertIsInstance(ext.get("route"), str, "usage.verity.route: %r" % ext)
        self.assertTrue(ext["route"], "usage.verity.route is empty")
        for key in ("cycles", "drafted", "accepted"):
            self.assertTrue(is_int(ext.get(key)), "usage.verity.%s must be an int: %r" % (key, ext))
            self.assertGreaterEqual(ext[key], 0)
        self.assertTrue(is_number(ext.get("accepted_per_cycle")),
                        "usage.verity.accepted_per_cycle must be a number: %r" % ext)
        self.assertGreaterEqual(ext["accepted_per_cycle"], 0)
        self.assertLessEqual(ext["accepted"], ext["drafted"], "accepted > drafted: %r" % ext)

    def assert_chat_completion(self, d, finish_reasons=FINISH_REASONS):
        """Check a raw ChatCompletion JSON object; returns choices[0]."""
        self.assertIsInstance(d, dict)
        self.assertIsInstance(d.get("id"), str)
        self.assertTrue(d["id"], "empty id")
        self.assertEqual(d.get("object"), "chat.completion")
        self.assertTrue(is_int(d.get("created")), "created must be an int: %r" % d.get("created"))
        self.assertIsInstance(d.get("model"), str)
        choices = d.get("choices")
        self.assertIsInstance(choices, list)
        self.assertEqual(len(choices), 1, "expected exactly one choice")
        choice = choices[0]
        self.assertEqual(choice.get("index"), 0)
        msg = choice.get("message")
        self.assertIsInstance(msg, dict)
        self.assertEqual(msg.get("role"), "assistant")
        self.assertIn(choice.get("finish_reason"), finish_reasons)
        if choice["finish_reason"] != "tool_calls":
            self.assertIsInstance(msg.get("content"), str, "message.content must be a string")
        self.assert_chat_usage(d.get("usage"))
        return choice

    def assert_error_response(self, res, allowed_status=None):
        """4xx with an OpenAI-style {"error": {"message", "type", ...}} body."""
        if allowed_status is None:
            self.assertTrue(400 <= res.status < 500, "expected a 4xx status, got %r" % res)
        else:
            self.assertIn(res.status, allowed_status, "unexpected status: %r" % res)
        try:
            body = res.json()
        except ValueError:
            body = None
        self.assertIsNotNone(body, "error body is not JSON: %r" % res)
        self.assertIsInstance(body, dict, "error body must be a JSON object: %r" % res)
        err = body.get("error")
        self.assertIsInstance(err, dict, "error body lacks an `error` object: %r" % res)
        self.assertIsInstance(err.get("message"), str, "error.message must be a string: %r" % err)
        self.assertTrue(err["message"], "error.message is empty")
        self.assertIsInstance(err.get("type"), str, "error.type must be a string: %r" % err)
        self.assertTrue(err["type"], "error.type is empty")
        return err

    def assert_healthy(self):
        res = http_request("GET", "/health", timeout=20)
        self.assertEqual(res.status, 200, "server unhealthy: %r" % res)
        self.assertEqual(res.json().get("status"), "ok")

    def parse_chat_stream(self, payloads, expect_usage_chunk=False):
        """Validate raw SSE payloads of a chat stream; return (text, finish_reason, usage)."""
        self.assertGreaterEqual(len(payloads), 2, "stream too short: %r" % payloads)
        self.assertEqual(payloads[-1], "[DONE]", "stream must end with data: [DONE]")
        self.assertNotIn("[DONE]", payloads[:-1], "data: [DONE] sent more than once")
        chunks = [json.loads(p) for p in payloads[:-1]]
        usage = None
        if expect_usage_chunk:
            last = chunks.pop()
            self.assertEqual(last.get("choices"), [], "usage chunk must have empty choices: %r" % last)
            usage = last.get("usage")
            self.assertIsInstance(usage, dict, "last chunk before [DONE] lacks usage: %r" % last)
            self.assert_usage(usage, "stream usage")
        self.assertTrue(chunks, "no content chunks")
        first_id = chunks[0].get("id")
        self.assertIsInstance(first_id, str)
        text, finish = [], None
        for i, c in enumerate(chunks):
            self.assertEqual(c.get("object"), "chat.completion.chunk", "chunk %d: %r" % (i, c))
            self.assertEqual(c.get("id"), first_id, "chunk ids differ")
            self.assertTrue(is_int(c.get("created")))
            self.assertIsInstance(c.get("model"), str)
            self.assertEqual(len(c.get("choices") or []), 1, "chunk %d must have one choice: %r" % (i, c))
            ch = c["choices"][0]
            self.assertIsNone(finish, "chunk after the finish_reason chunk: %r" % c)
            delta = ch.get("delta")
            self.assertIsInstance(delta, dict)
            if i == 0:
                self.assertEqual(delta.get("role"), "assistant", "first delta must carry the role")
            if delta.get("content") is not None:
                self.assertIsInstance(delta["content"], str)
                text.append(delta["content"])
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
        self.assertIn(finish, FINISH_REASONS, "no final chunk with a finish_reason")
        return "".join(text), finish, usage


# --------------------------------------------------------------------------
# Service endpoints
# --------------------------------------------------------------------------

PROM_SAMPLE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+-?\d+)?$")


def parse_prometheus(text):
    """[(name, labels, value)] for the sample lines of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PROM_SAMPLE.match(line)
        if not m:
            raise AssertionError("not a Prometheus sample line: %r" % line)
        samples.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return samples


def metric_sum(samples, name):
    return sum(v for n, _, v in samples if n == name)


class TestService(ServerTestCase):

    def test_health(self):
        res = http_request("GET", "/health")
        self.assertEqual(res.status, 200)
        self.assertEqual(res.json().get("status"), "ok")

    def test_models_raw(self):
        res = http_request("GET", "/v1/models")
        self.assertEqual(res.status, 200, res)
        body = res.json()
        self.assertEqual(body.get("object"), "list")
        self.assertIsInstance(body.get("data"), list)
        entries = [m for m in body["data"] if m.get("id") == CFG.model]
        self.assertEqual(len(entries), 1, "model %r not listed: %r" % (CFG.model, body))
        self.assertEqual(entries[0].get("object"), "model")
        self.assertEqual(entries[0].get("owned_by"), "verity")

    def test_models_client(self):
        ids = [m.id for m in client().models.list()]
        self.assertIn(CFG.model, ids)

    def test_metrics(self):
        before = http_request("GET", "/metrics")
        self.assertEqual(before.status, 200, before)
        ctype = before.headers.get("content-type", "")
        self.assertTrue(ctype.startswith("text/plain") or ctype.startswith("application/openmetrics-text"),
                        "unexpected metrics content type %r" % ctype)
        chat(messages=STORY, temperature=0, max_tokens=4)
        after = http_request("GET", "/metrics")
        self.assertEqual(after.status, 200, after)
        samples = parse_prometheus(after.text())
        names = {n for n, _, _ in samples}
        for required in ("verity_requests_total", "verity_completion_tokens_total",
                         "verity_ttft_seconds", "verity_spec_cycles_total"):
            variants = {required, required + "_bucket", required + "_sum", required + "_count"}
            self.assertTrue(names & variants, "metric %s missing from /metrics" % required)
        old = parse_prometheus(before.text())
        self.assertGreaterEqual(metric_sum(samples, "verity_requests_total"),
                                metric_sum(old, "verity_requests_total") + 1,
                                "verity_requests_total did not count a request")
        self.assertGreaterEqual(metric_sum(samples, "verity_completion_tokens_total"),
                                metric_sum(old, "verity_completion_tokens_total") + 4,
                                "verity_completion_tokens_total did not count 4 tokens")
        # Gauges: nothing runs between requests; the conversation's K/V and the prefix cache's checkpoints are
        # held after one.
        self.assertEqual(metric_sum(samples, "verity_active_generations"), 0)
        self.assertGreater(metric_sum(samples, "verity_kv_cache_bytes"), 0)
        self.assertGreaterEqual(metric_sum(samples, "verity_prefix_cache_ram_entries"), 1)
        self.assertGreater(metric_sum(samples, "verity_prefix_cache_ram_bytes"), 0)


# --------------------------------------------------------------------------
# Chat completions (non-streaming)
# --------------------------------------------------------------------------

class TestChatCompletions(ServerTestCase):

    def test_response_schema_raw_http(self):
        res = post_json("/v1/chat/completions", {
            "model": CFG.model, "messages": CAPITAL, "temperature": 0, "n": 1,
            "max_tokens": CAPITAL_MAX_TOKENS})
        self.assertEqual(res.status, 200, res)
        self.assertTrue(res.headers.get("content-type", "").startswith("application/json"))
        body = res.json()
        self.assert_chat_completion(body)
        self.assertEqual(body["model"], CFG.model)

    def test_known_answer_tokyo(self):
        resp, raw = capital_greedy()
        self.assert_chat_completion(raw)
        self.assertIn("Tokyo", resp.choices[0].message.content)

    def test_max_tokens_hits_length(self):
        _, raw = chat(messages=STORY, temperature=0, max_tokens=8)
        choice = self.assert_chat_completion(raw)
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(raw["usage"]["completion_tokens"], 8)

    def test_max_completion_tokens_hits_length(self):
        _, raw = chat(messages=STORY, temperature=0, max_completion_tokens=6)
        choice = self.assert_chat_completion(raw)
        self.assertEqual(choice["finish_reason"], "length")
        self.assertEqual(raw["usage"]["completion_tokens"], 6)

    def _check_stop(self, stop):
        full = capital_greedy()[0].choices[0].message.content
        self.assertIn("Tokyo", full, "precondition: greedy answer mentions Tokyo")
        _, raw = chat(messages=CAPITAL, temperature=0, max_tokens=CAPITAL_MAX_TOKENS, stop=stop)
        choice = self.assert_chat_completion(raw)
        content = choice["message"]["content"]
        self.assertNotIn("Tokyo", content)
        self.assertEqual(choice["finish_reason"], "stop")
        self.assertTrue(full.startswith(content),
                        "stopped text %r is not a prefix of the full answer %r" % (content, full))

    def test_stop_string(self):
        self._check_stop("Tokyo")

    def test_stop_list(self):
        self._check_stop(["@@never-appears@@", "Tokyo"])

    def test_n_other_than_one_rejected(self):
        with self.assertRaises(openai.BadRequestError):
            chat(messages=CAPITAL, max_tokens=8, n=2)

    def test_logprobs(self):
        _, raw = chat(messages=STORY, temperature=0, max_tokens=8, logprobs=True, top_logprobs=1)
        choice = self.assert_chat_completion(raw)
        lp = choice.get("logprobs")
        self.assertIsInstance(lp, dict, "choices[0].logprobs missing")
        content = lp.get("content")
        self.assertIsInstance(content, list)
        self.assertEqual(len(content), raw["usage"]["completion_tokens"],
                         "one logprobs entry per completion token")
        for entry in content:
            self.assertIsInstance(entry.get("token"), str)
            self.assertTrue(is_number(entry.get("logprob")))
            self.assertLessEqual(entry["logprob"], 0.0)
            tops = entry.get("top_logprobs")
            self.assertIsInstance(tops, list)
            self.assertEqual(len(tops), 1, "top_logprobs=1 must give one alternative")
            self.assertIsInstance(tops[0].get("token"), str)
            self.assertLessEqual(tops[0].get("logprob"), 0.0)
            # Greedy decoding picks the most likely token.
            self.assertEqual(tops[0]["token"], entry["token"])
            self.assertAlmostEqual(tops[0]["logprob"], entry["logprob"], places=3)

    def test_sampling_fields_accepted(self):
        _, raw = chat(messages=CAPITAL, temperature=0.7, top_p=0.9, seed=7, max_tokens=12,
                      extra_body={"top_k": 40, "min_p": 0.05})
        self.assert_chat_completion(raw)

    def test_seed_reproducible(self):
        kwargs = dict(messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                      temperature=0.8, seed=1234, max_tokens=24)
        a, _ = chat(**kwargs)
        b, _ = chat(**kwargs)
        self.assertEqual(a.choices[0].message.content, b.choices[0].message.content)

    def test_top_k_1_matches_greedy(self):
        greedy = capital_greedy()[0].choices[0].message.content
        resp, _ = chat(messages=CAPITAL, temperature=1.0, seed=3, max_tokens=CAPITAL_MAX_TOKENS,
                       extra_body={"top_k": 1})
        self.assertEqual(resp.choices[0].message.content, greedy)

    def test_speculation_off_and_auto_agree(self):
        _, off = chat(messages=CAPITAL, temperature=0, max_tokens=CAPITAL_MAX_TOKENS,
                      extra_body={"speculation": "off"})
        _, auto = chat(messages=CAPITAL, temperature=0, max_tokens=CAPITAL_MAX_TOKENS,
                       extra_body={"speculation": "auto"})
        self.assert_chat_completion(off)
        self.assert_chat_completion(auto)
        self.assertEqual(off["usage"]["verity"]["route"], "ar")
        self.assertEqual(off["choices"][0]["message"]["content"], auto["choices"][0]["message"]["content"])
        self.assertEqual(off["choices"][0]["message"]["content"],
                         capital_greedy()[0].choices[0].message.content)


# --------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------

class TestStreaming(ServerTestCase):

    def test_client_stream_matches_non_streaming(self):
        expected = capital_greedy()[0].choices[0].message.content
        stream = client().chat.completions.create(
            model=CFG.model, messages=CAPITAL, temperature=0, max_tokens=CAPITAL_MAX_TOKENS, stream=True)
        parts, roles, finish = [], [], None
        for chunk in stream:
            self.assertEqual(chunk.object, "chat.completion.chunk")
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.role:
                roles.append(delta.role)
            if delta.content:
                parts.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        self.assertEqual(roles[:1], ["assistant"])
        self.assertIn(finish, FINISH_REASONS)
        self.assertEqual("".join(parts), expected)

    def test_raw_sse_format(self):
        expected = capital_greedy()[0].choices[0].message.content
        status, headers, payloads = stream_raw("/v1/chat/completions", {
            "model": CFG.model, "messages": CAPITAL, "temperature": 0,
            "max_tokens": CAPITAL_MAX_TOKENS, "stream": True})
        self.assertEqual(status, 200, payloads)
        self.assertTrue(headers.get("content-type", "").startswith("text/event-stream"),
                        "content-type %r" % headers.get("content-type"))
        text, finish, _ = self.parse_chat_stream(payloads)
        self.assertEqual(text, expected)
        self.assertEqual(finish, capital_greedy()[1]["choices"][0]["finish_reason"])

    def test_include_usage(self):
        expected = capital_greedy()[1]
        status, _, payloads = stream_raw("/v1/chat/completions", {
            "model": CFG.model, "messages": CAPITAL, "temperature": 0,
            "max_tokens": CAPITAL_MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}})
        self.assertEqual(status, 200, payloads)
        text, _, usage = self.parse_chat_stream(payloads, expect_usage_chunk=True)
        self.assertEqual(text, expected["choices"][0]["message"]["content"])
        self.assertEqual(usage["completion_tokens"], expected["usage"]["completion_tokens"])
        self.assertEqual(usage["prompt_tokens"], expected["usage"]["prompt_tokens"])

    def test_client_include_usage(self):
        usage_chunks = []
        stream = client().chat.completions.create(
            model=CFG.model, messages=CAPITAL, temperature=0, max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage_chunks.append(chunk)
        self.assertEqual(len(usage_chunks), 1)
        self.assertEqual(usage_chunks[0].choices, [])
        self.assertGreater(usage_chunks[0].usage.completion_tokens, 0)


# --------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------

def unique_context():
    """A long, run-unique first message, so cache hits can only come from this test."""
    tag = uuid.uuid4().hex
    facts = " ".join("Fact %d: the code word %d is %s%d." % (i, i, tag[i % 32:i % 32 + 6], i)
                     for i in range(12))
    return "Remember these notes. %s Now answer briefly: what is 2 plus 2?" % facts


class TestPrefixCache(ServerTestCase):

    def test_multi_turn_reuses_prefix(self):
        turn1 = [{"role": "user", "content": unique_context()}]
        r1, raw1 = chat(messages=turn1, temperature=0, max_tokens=16)
        self.assert_chat_completion(raw1)
        turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "And what is 3 plus 3?"}]
        _, raw2 = chat(messages=turn2, temperature=0, max_tokens=16)
        self.assert_chat_completion(raw2)
        cached1 = raw1["usage"]["prompt_tokens_details"]["cached_tokens"]
        cached2 = raw2["usage"]["prompt_tokens_details"]["cached_tokens"]
        self.assertGreater(cached2, 0, "second turn reused no prefix")
        # The unique first turn only existed in this test, so reuse must exceed
        # whatever (e.g. a shared system prompt) turn 1 itself found cached.
        self.assertGreater(cached2, cached1, "second turn did not reuse the first turn's tokens")

    def test_cache_reset(self):
        messages = [{"role": "user", "content": "Say hello. (%s)" % uuid.uuid4().hex}]
        chat(messages=messages, temperature=0, max_tokens=8)
        _, again = chat(messages=messages, temperature=0, max_tokens=8)
        self.assertGreater(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
                           "precondition: a repeated request reuses the cached prefix")
        res = post_json("/v1/cache/reset", {})
        self.assertEqual(res.status, 200, res)
        _, after = chat(messages=messages, temperature=0, max_tokens=8)
        self.assertEqual(after["usage"]["prompt_tokens_details"]["cached_tokens"], 0)


# --------------------------------------------------------------------------
# Legacy completions
# --------------------------------------------------------------------------

class TestCompletions(ServerTestCase):
    PROMPT = "The capital of France is"

    def test_completion(self):
        raw = client().completions.with_raw_response.create(
            model=CFG.model, prompt=self.PROMPT, max_tokens=8, temperature=0)
        resp, body = raw.parse(), json.loads(raw.text)
        self.assertEqual(body.get("object"), "text_completion")
        self.assertIsInstance(body.get("id"), str)
        self.assertTrue(is_int(body.get("created")))
        self.assertEqual(len(body.get("choices") or []), 1)
        self.assertIsInstance(body["choices"][0].get("text"), str)
        self.assertTrue(body["choices"][0]["text"], "empty completion text")
        self.assertIn(body["choices"][0].get("finish_reason"), FINISH_REASONS)
        self.assert_usage(body.get("usage"))
        self.assertEqual(resp.choices[0].text, body["choices"][0]["text"])

    def test_completion_stream(self):
        stream = client().completions.create(
            model=CFG.model, prompt=self.PROMPT, max_tokens=8, temperature=0, stream=True)
        parts, finish = [], None
        for chunk in stream:
            self.assertEqual(chunk.object, "text_completion")
            if chunk.choices:
                parts.append(chunk.choices[0].text or "")
                finish = chunk.choices[0].finish_reason or finish
        self.assertTrue("".join(parts), "streamed completion text is empty")
        self.assertIn(finish, FINISH_REASONS)


# --------------------------------------------------------------------------
# Structured output: JSON answers, tool calls, reasoning switches
# --------------------------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class TestStructuredOutput(ServerTestCase):

    def _parse_json_content(self, raw):
        choice = self.assert_chat_completion(raw)
        content = choice["message"]["content"]
        try:
            return json.loads(content)
        except ValueError:
            pass
        self.fail("content is not JSON (finish_reason=%s): %r" % (choice["finish_reason"], content))

    def test_response_format_json_object(self):
        _, raw = chat(
            messages=[{"role": "user", "content":
                       "Reply with a JSON object with one key \"city\" naming the capital of France."}],
            temperature=0, max_tokens=48, response_format={"type": "json_object"})
        value = self._parse_json_content(raw)
        self.assertIsInstance(value, dict, "json_object must produce a JSON object")

    def test_response_format_json_schema(self):
        _, raw = chat(
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            temperature=0, max_tokens=48,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": CITY_SCHEMA}})
        value = self._parse_json_content(raw)
        self.assertIsInstance(value, dict)
        self.assertEqual(set(value), {"city"}, "schema allows exactly the key 'city': %r" % value)
        self.assertIsInstance(value["city"], str)

    def test_tools_forced_function(self):
        _, raw = chat(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            temperature=0, max_tokens=48, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = self.assert_chat_completion(raw, finish_reasons=("tool_calls",))
        calls = choice["message"].get("tool_calls")
        self.assertIsInstance(calls, list)
        self.assertGreaterEqual(len(calls), 1)
        call = calls[0]
        self.assertIsInstance(call.get("id"), str)
        self.assertEqual(call.get("type"), "function")
        self.assertEqual(call["function"]["name"], "get_weather")
        try:
            args = json.loads(call["function"]["arguments"])
        except (TypeError, ValueError):
            args = None
        self.assertIsInstance(args, dict, "tool call arguments are not a JSON object: %r"
                              % call["function"].get("arguments"))
        self.assertIsInstance(args.get("city"), str, "arguments follow the tool's schema: %r" % args)

    def test_tools_required_streamed_as_a_tool_calls_delta(self):
        stream = client().chat.completions.create(
            model=CFG.model, stream=True, temperature=0, max_tokens=48,
            messages=[{"role": "user", "content": "What is the weather in Rome?"}],
            tools=[WEATHER_TOOL], tool_choice="required")
        calls, finish = [], None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.tool_calls:
                calls.extend(delta.tool_calls)
            finish = chunk.choices[0].finish_reason or finish
        self.assertEqual(finish, "tool_calls")
        self.assertGreaterEqual(len(calls), 1)
        self.assertEqual(calls[0].function.name, "get_weather")
        self.assertIsInstance(json.loads(calls[0].function.arguments), dict)

    def test_tools_auto_answers_with_text_or_calls(self):
        _, raw = chat(
            messages=[{"role": "user", "content": "Say hello."}],
            temperature=0, max_tokens=24, tools=[WEATHER_TOOL], tool_choice="auto")
        choice = self.assert_chat_completion(raw, finish_reasons=("stop", "length", "tool_calls"))
        msg = choice["message"]
        self.assertTrue(msg.get("content") or msg.get("tool_calls"))

    def test_a_tool_round_trip_in_the_history_is_accepted(self):
        _, raw = chat(
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature_c\": 21}"},
            ],
            temperature=0, max_tokens=24, tools=[WEATHER_TOOL])
        self.assert_chat_completion(raw, finish_reasons=("stop", "length", "tool_calls"))

    def test_json_schema_streamed_concatenates_to_valid_json(self):
        stream = client().chat.completions.create(
            model=CFG.model, stream=True, temperature=0, max_tokens=48,
            messages=[{"role": "user", "content": "Name a city as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        value = json.loads(text)
        self.assertEqual(set(value), {"city"})

    def test_reasoning_switches_are_accepted(self):
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                      {"reasoning_effort": "none"}, {"reasoning_effort": "high"}):
            _, raw = chat(messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4,
                          extra_body=extra)
            self.assert_chat_completion(raw)


# --------------------------------------------------------------------------
# Cancellation and concurrency
# --------------------------------------------------------------------------

class TestRobustness(ServerTestCase):

    def test_cancel_on_disconnect(self):
        payload = {"model": CFG.model, "stream": True, "temperature": 0, "max_tokens": 2000,
                   "messages": [{"role": "user", "content":
                                 "Count from 1 to 1000, separated by commas."}]}
        conn = http.client.HTTPConnection(CFG.host, CFG.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(payload).encode("utf-8"),
                     headers=dict(auth_headers(), **{"Content-Type": "application/json"}))
        sock = conn.sock  # keep it: getresponse() may detach it from conn
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        events = iter_sse_data(resp)
        first = [next(events), next(events)]
        for p in first:
            self.assertEqual(json.loads(p).get("object"), "chat.completion.chunk")
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        resp.close()
        conn.close()

        start = time.monotonic()
        _, raw = chat(messages=CAPITAL, temperature=0, max_tokens=16, timeout=30)
        elapsed = time.monotonic() - start
        self.assert_chat_completion(raw)
        self.assertLess(elapsed, 20.0, "request after a disconnect took %.1fs: "
                        "the abandoned generation kept running" % elapsed)

    def test_concurrent_requests(self):
        prompts = ["Name a color.", "Name a fruit.", "Name an animal.", "Name a country."]
        barrier = threading.Barrier(len(prompts))
        results = [None] * len(prompts)

        def worker(i):
            try:
                barrier.wait(timeout=10)
                results[i] = post_json("/v1/chat/completions", {
                    "model": CFG.model, "temperature": 0, "max_tokens": 16,
                    "messages": [{"role": "user", "content": prompts[i]}]}, timeout=90)
            except Exception as e:  # reported below
                results[i] = e

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, res in enumerate(results):
            with self.subTest(prompt=prompts[i]):
                self.assertIsInstance(res, HttpResult, "request failed: %r" % (res,))
                self.assertEqual(res.status, 200, res)
                self.assert_chat_completion(res.json())


# --------------------------------------------------------------------------
# Bad input (raw HTTP). One generated test per case.
# --------------------------------------------------------------------------

def _chat_body(**overrides):
    body = {"model": None, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    body.update(overrides)
    if body["model"] is None:
        body["model"] = CFG.model
    return body


def _without(key):
    def build():
        body = _chat_body()
        del body[key]
        return body
    return build


# name -> (method, path, body builder: () -> bytes|dict|list|None, allowed statuses or None for any 4xx)
BAD_INPUT_CASES = [
    ("malformed_json", "POST", "/v1/chat/completions",
     lambda: b'{"model": "x", "messages": [', None),
    ("json_array_body", "POST", "/v1/chat/completions",
     lambda: [_chat_body()], None),
    ("missing_messages", "POST", "/v1/chat/completions", _without("messages"), None),
    ("empty_messages", "POST", "/v1/chat/completions", lambda: _chat_body(messages=[]), None),
    ("unknown_role", "POST", "/v1/chat/completions",
     lambda: _chat_body(messages=[{"role": "wizard", "content": "Hi"}]), None),
    ("content_wrong_type", "POST", "/v1/chat/completions",
     lambda: _chat_body(messages=[{"role": "user", "content": 42}]), None),
    ("temperature_negative", "POST", "/v1/chat/completions", lambda: _chat_body(temperature=-1), None),
    ("temperature_string", "POST", "/v1/chat/completions", lambda: _chat_body(temperature="hot"), None),
    ("top_p_above_one", "POST", "/v1/chat/completions", lambda: _chat_body(top_p=1.5), None),
    ("max_tokens_zero", "POST", "/v1/chat/completions", lambda: _chat_body(max_tokens=0), None),
    ("max_tokens_exceeds_context", "POST", "/v1/chat/completions",
     lambda: _chat_body(max_tokens=10 ** 9), (400,)),
    ("unknown_model", "POST", "/v1/chat/completions", lambda: _chat_body(model="nope"), (400, 404)),
    ("n_three", "POST", "/v1/chat/completions", lambda: _chat_body(n=3), (400,)),
    ("stop_number", "POST", "/v1/chat/completions", lambda: _chat_body(stop=5), None),
    ("response_format_xml", "POST", "/v1/chat/completions",
     lambda: _chat_body(response_format={"type": "xml"}), None),
    ("json_schema_without_schema", "POST", "/v1/chat/completions",
     lambda: _chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), (400,)),
    ("json_schema_that_does_not_compile", "POST", "/v1/chat/completions",
     lambda: _chat_body(response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}},
                                 "required": ["a"]}}}), (400,)),
    ("tools_not_a_list", "POST", "/v1/chat/completions",
     lambda: _chat_body(tools={"type": "function"}), (400,)),
    ("tool_without_name", "POST", "/v1/chat/completions",
     lambda: _chat_body(tools=[{"type": "function", "function": {"parameters": {}}}]), (400,)),
    ("tool_choice_unknown_function", "POST", "/v1/chat/completions",
     lambda: _chat_body(tools=[WEATHER_TOOL],
                        tool_choice={"type": "function", "function": {"name": "nope"}}), (400,)),
    ("tool_choice_required_without_tools", "POST", "/v1/chat/completions",
     lambda: _chat_body(tool_choice="required"), (400,)),
    ("tool_calls_on_a_user_message", "POST", "/v1/chat/completions",
     lambda: _chat_body(messages=[{"role": "user", "content": "x", "tool_calls": [
         {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), (400,)),
    ("chat_template_kwargs_not_an_object", "POST", "/v1/chat/completions",
     lambda: _chat_body(chat_template_kwargs=[1]), (400,)),
    ("reasoning_effort_unknown", "POST", "/v1/chat/completions",
     lambda: _chat_body(reasoning_effort="extreme"), (400,)),
    ("top_logprobs_without_logprobs", "POST", "/v1/chat/completions",
     lambda: _chat_body(top_logprobs=2), (400,)),
    ("top_logprobs_out_of_range", "POST", "/v1/chat/completions",
     lambda: _chat_body(logprobs=True, top_logprobs=21), (400,)),
    ("get_on_chat_completions", "GET", "/v1/chat/completions", lambda: None, (405,)),
    ("body_10mb", "POST", "/v1/chat/completions",
     lambda: _chat_body(messages=[{"role": "user", "content": "a" * (10 * 1024 * 1024)}]), (400, 413)),
]


class TestBadInput(ServerTestCase):
    """Each case must be rejected with a 4xx OpenAI-style error, leaving the server healthy."""

    def run_case(self, name, method, path, build, allowed):
        body = build()
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode("utf-8")
        if body is not None and len(body) > 1024 * 1024:
            res = send_oversized(path, body)
        else:
            res = http_request(method, path, body, timeout=30)
        err = self.assert_error_response(res, allowed)
        if name == "unknown_model" and res.status == 404:
            self.assertEqual(err.get("type"), "model_not_found")
        self.assert_healthy()


def _install_bad_input_tests():
    for case in BAD_INPUT_CASES:
        def test(self, case=case):
            self.run_case(*case)
        test.__name__ = "test_" + case[0]
        test.__doc__ = None
        setattr(TestBadInput, test.__name__, test)


_install_bad_input_tests()


# --------------------------------------------------------------------------
# Access: API key, Content-Type, Origin, Host
# --------------------------------------------------------------------------

class TestAccess(ServerTestCase):

    def test_wrong_api_key_is_refused(self):
        if not CFG.api_key:
            self.skipTest("the server runs without --api-key")
        wrong = openai.OpenAI(base_url=CFG.base_url + "/v1", api_key=CFG.api_key + "-wrong",
                              max_retries=0, timeout=CFG.request_timeout)
        with self.assertRaises(openai.AuthenticationError) as caught:
            wrong.models.list()
        self.assertEqual(error_of(caught.exception).get("code"), "invalid_api_key")

    def test_text_plain_post_is_refused(self):
        body = json.dumps(_chat_body()).encode("utf-8")
        res = http_request("POST", "/v1/chat/completions", body, headers={"Content-Type": "text/plain"})
        self.assert_error_response(res, (415,))
        self.assert_healthy()

    def test_foreign_origin_is_refused(self):
        res = http_request("GET", "/v1/models", headers={"Origin": "http://evil.example"})
        self.assert_error_response(res, (403,))

    def test_foreign_host_is_refused(self):
        res = http_request("GET", "/v1/models", headers={"Host": "evil.example"})
        self.assert_error_response(res, (421,))


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

def wait_until_healthy(seconds):
    deadline = time.monotonic() + seconds
    last = None
    while time.monotonic() < deadline:
        try:
            res = http_request("GET", "/health", timeout=5)
            if res.status == 200:
                return
            last = res
        except OSError as e:
            last = e
        time.sleep(0.25)
    sys.stdout.write("server at %s not healthy after %.0fs: %r\n" % (CFG.base_url, seconds, last))
    sys.stdout.flush()
    sys.exit(2)


def start_watchdog(seconds):
    def expire():
        sys.stdout.write("\nDEADLINE: test run exceeded %.0fs; aborting\n" % seconds)
        sys.stdout.flush()
        os._exit(3)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080 (no /v1)")
    parser.add_argument("--model", default="smollm2-135m", help="served model id")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if any")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for /health first")
    parser.add_argument("--deadline", type=float, default=360.0, help="abort the whole run after this")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    args, rest = parser.parse_known_args()

    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    url = urllib.parse.urlsplit(base)
    if url.scheme != "http" or not url.hostname:
        parser.error("--base-url must look like http://HOST:PORT")
    CFG.base_url = base
    CFG.host = url.hostname
    CFG.port = url.port or 80
    CFG.model = args.model
    CFG.api_key = args.api_key
    CFG.request_timeout = args.timeout
    # Never route the loopback test traffic through a proxy from the environment.
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), CFG.host, "localhost", "127.0.0.1"]))
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = no_proxy

    start_watchdog(args.deadline)
    wait_until_healthy(args.wait)

    started = time.monotonic()
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2)
    prog = unittest.main(module=sys.modules[__name__], argv=[sys.argv[0]] + rest,
                         testRunner=runner, exit=False)
    result = prog.result
    sys.stdout.write("\nverity serve tests: %s in %.1fs (ran %d, failures %d, errors %d, skipped %d)\n" % (
        "PASS" if result.wasSuccessful() else "FAIL", time.monotonic() - started, result.testsRun,
        len(result.failures), len(result.errors), len(result.skipped)))
    sys.stdout.flush()
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
