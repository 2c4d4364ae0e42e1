#!/usr/bin/env python3
"""End-to-end tests of `verity serve`'s Anthropic Messages API (`POST /v1/messages`) with the official
`anthropic` Python client, beside the OpenAI suite (test_server.py) on the same server.

Usage (normally launched by a Rust integration test against a live server):

    python3 crates/verity-cli/tests/python/test_anthropic.py \
        --base-url http://127.0.0.1:PORT --model smollm2-135m [--api-key KEY] [unittest args]

Covered:
  * A plain message: the Message schema (id, type, role, model, content blocks, stop_reason, usage), a known
    greedy answer ("capital of Japan" -> Tokyo), and the same text as the OpenAI endpoint's greedy answer to
    the same conversation (one request model behind both APIs).
  * System prompts (string and text blocks), multi-turn history, seeded sampling reproduces itself, structured
    output (output_config.format) follows its schema.
  * stop_reason: max_tokens (exact output_tokens), stop_sequence (with the sequence reported), end_turn.
  * Streaming: the event sequence (message_start, content_block_start/delta/stop, message_delta,
    message_stop), the streamed text equal to the non-streamed greedy text, the client's final message.
  * Tools: tool_choice any / a named tool forces a tool_use block following the input_schema (stop_reason
    tool_use), streamed as an input_json_delta; a tool_use / tool_result round trip in the history.
  * Errors: missing max_tokens, an image block, an unknown model, a wrong API key (each the client's typed
    error, with the Messages API's error body).
"""

import argparse
import json
import os
import sys
import threading
import time
import unittest
import urllib.parse
import urllib.request

try:
    import anthropic
except ImportError:  # pragma: no cover - environment problem, not a test failure mode
    sys.stderr.write("test_anthropic.py needs the `anthropic` package: pip install anthropic\n")
    sys.exit(2)


class Config:
    base_url = "http://127.0.0.1:8080"
    model = "smollm2-135m"
    api_key = None
    timeout = 60.0


CFG = Config()

CAPITAL = [{"role": "user", "content": "What is the capital of Japan?"}]
STORY = [{"role": "user", "content": "Write a long story about a brave knight and a dragon."}]
# Current clients have no sampling arguments; the server takes them from the body (OpenAI's defaults otherwise).
GREEDY = {"temperature": 0}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def client(api_key=None):
    return anthropic.Anthropic(base_url=CFG.base_url, api_key=api_key or CFG.api_key or "none",
                               timeout=CFG.timeout, max_retries=0)


def raw_post(path, body, headers=None):
    """POST JSON with the stdlib; returns (status, parsed body)."""
    req = urllib.request.Request(CFG.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    if CFG.api_key:
        req.add_header("x-api-key", CFG.api_key)
    try:
        with urllib.request.urlopen(req, timeout=CFG.timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


class TestMessages(unittest.TestCase):

    def create(self, **kw):
        kw.setdefault("model", CFG.model)
        kw.setdefault("max_tokens", 32)
        return client().messages.create(**kw)

    def test_message_schema_and_known_answer(self):
        m = self.create(messages=CAPITAL, extra_body=GREEDY)
        self.assertTrue(m.id.startswith("msg_"))
        self.assertEqual((m.type, m.role, m.model), ("message", "assistant", CFG.model))
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
        self.assertIsNone(m.stop_sequence)
        self.assertEqual([b.type for b in m.content], ["text"])
        self.assertIn("Tokyo", text_of(m))
        self.assertGreater(m.usage.input_tokens, 0)
        self.assertGreater(m.usage.output_tokens, 0)

    def test_the_same_answer_as_the_openai_endpoint(self):
        m = self.create(messages=CAPITAL, extra_body=GREEDY, system="You are a helpful assistant.")
        status, body = raw_post("/v1/chat/completions", {
            "model": CFG.model, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a helpful assistant."}] + CAPITAL,
        })
        self.assertEqual(status, 200, body)
        self.assertEqual(text_of(m), body["choices"][0]["message"]["content"])
        self.assertEqual(m.usage.output_tokens, body["usage"]["completion_tokens"])

    def test_system_prompt_as_blocks_equals_the_string(self):
        a = self.create(messages=CAPITAL, extra_body=GREEDY, system="Answer in one word.")
        b = self.create(messages=CAPITAL, extra_body=GREEDY,
                        system=[{"type": "text", "text": "Answer in one word."}])
        self.assertEqual(text_of(a), text_of(b))

    def test_structured_output_follows_the_schema(self):
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
        m = self.create(messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
                        max_tokens=48, extra_body=GREEDY, output_config={"format": {"type": "json_schema",
                                                                                  "schema": schema}})
        value = json.loads(text_of(m))
        self.assertEqual(set(value), {"city"})

    def test_multi_turn_history(self):
        m = self.create(extra_body=GREEDY, messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
            {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]},
        ])
        self.assertTrue(text_of(m))

    def test_seeded_sampling_reproduces_itself(self):
        a = self.create(messages=STORY, extra_body={"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7})
        b = self.create(messages=STORY, extra_body={"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 7})
        self.assertEqual(text_of(a), text_of(b))

    def test_max_tokens_stops_with_max_tokens(self):
        m = self.create(messages=STORY, extra_body=GREEDY, max_tokens=5)
        self.assertEqual(m.stop_reason, "max_tokens")
        self.assertEqual(m.usage.output_tokens, 5)

    def test_a_stop_sequence_is_reported(self):
        greedy = text_of(self.create(messages=STORY, extra_body=GREEDY, max_tokens=48))
        words = greedy.split()
        self.assertGreater(len(words), 4, greedy)
        stop = words[3]
        m = self.create(messages=STORY, extra_body=GREEDY, max_tokens=48, stop_sequences=["\u2603", stop])
        self.assertEqual(m.stop_reason, "stop_sequence")
        self.assertEqual(m.stop_sequence, stop)
        self.assertEqual(text_of(m), greedy[:greedy.index(stop)])


class TestStreaming(unittest.TestCase):

    def test_events_and_text_match_the_whole_answer(self):
        whole = client().messages.create(model=CFG.model, max_tokens=32, extra_body=GREEDY, messages=CAPITAL)
        kinds, pieces = [], []
        with client().messages.stream(model=CFG.model, max_tokens=32, extra_body=GREEDY,
                                      messages=CAPITAL) as stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    pieces.append(event.delta.text)
            final = stream.get_final_message()
        self.assertEqual(kinds[0], "message_start")
        self.assertEqual(kinds[1], "content_block_start")
        self.assertIn("content_block_stop", kinds)
        self.assertIn("message_delta", kinds)
        self.assertEqual(kinds[-1], "message_stop")
        self.assertEqual("".join(pieces), text_of(whole))
        self.assertEqual(text_of(final), text_of(whole))
        self.assertEqual(final.stop_reason, whole.stop_reason)
        self.assertEqual(final.usage.output_tokens, whole.usage.output_tokens)

    def test_text_stream_helper(self):
        with client().messages.stream(model=CFG.model, max_tokens=6, extra_body=GREEDY,
                                      messages=STORY) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(text, text_of(final))
        self.assertEqual(final.stop_reason, "max_tokens")


class TestTools(unittest.TestCase):

    def check_call(self, m):
        self.assertEqual(m.stop_reason, "tool_use")
        uses = [b for b in m.content if b.type == "tool_use"]
        self.assertGreaterEqual(len(uses), 1, m.content)
        self.assertEqual(uses[0].name, "get_weather")
        self.assertTrue(uses[0].id.startswith("toolu_"))
        self.assertIsInstance(uses[0].input, dict)
        self.assertIsInstance(uses[0].input.get("city"), str, uses[0].input)
        return uses[0]

    def test_any_tool_choice_forces_a_call(self):
        m = client().messages.create(model=CFG.model, max_tokens=48, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                     tool_choice={"type": "any"},
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        self.check_call(m)

    def test_a_named_tool_streams_as_input_json(self):
        with client().messages.stream(model=CFG.model, max_tokens=48, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                      tool_choice={"type": "tool", "name": "get_weather"},
                                      messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        self.check_call(final)
        self.assertIn("content_block_start", kinds)

    def test_a_tool_round_trip(self):
        first = client().messages.create(
            model=CFG.model, max_tokens=48, extra_body=GREEDY, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        use = self.check_call(first)
        m = client().messages.create(
            model=CFG.model, max_tokens=24, extra_body=GREEDY, tools=[WEATHER_TOOL],
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "{\"temperature_c\": 21}"}]},
            ])
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens", "tool_use"))


class TestErrors(unittest.TestCase):

    def test_missing_max_tokens_is_a_bad_request(self):
        status, body = raw_post("/v1/messages", {"model": CFG.model, "messages": CAPITAL})
        self.assertEqual(status, 400)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("max_tokens", body["error"]["message"])

    def test_an_image_block_is_refused_by_name(self):
        with self.assertRaises(anthropic.BadRequestError) as e:
            client().messages.create(model=CFG.model, max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        self.assertIn("image", str(e.exception))

    def test_an_unknown_model_is_not_found(self):
        with self.assertRaises(anthropic.NotFoundError):
            client().messages.create(model="no-such-model", max_tokens=8, messages=CAPITAL)

    def test_a_wrong_api_key_is_refused(self):
        if not CFG.api_key:
            self.skipTest("the server runs without an API key")
        with self.assertRaises(anthropic.AuthenticationError) as e:
            client(api_key="wrong").messages.create(model=CFG.model, max_tokens=8, messages=CAPITAL)
        self.assertEqual(e.exception.body["error"]["type"], "authentication_error")

    def test_the_server_stays_healthy(self):
        with urllib.request.urlopen(CFG.base_url + "/health", timeout=CFG.timeout) as r:
            self.assertEqual(r.status, 200)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--deadline", type=float, default=300.0, help="abort the whole run after this")
    args, rest = parser.parse_known_args()
    CFG.base_url = args.base_url.rstrip("/")
    CFG.model = args.model
    CFG.api_key = args.api_key
    host = urllib.parse.urlsplit(CFG.base_url).hostname
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join([host, "localhost", "127.0.0.1"])
    timer = threading.Timer(args.deadline, lambda: (sys.stdout.write("\nDEADLINE exceeded\n"), os._exit(3)))
    timer.daemon = True
    timer.start()
    started = time.monotonic()
    runner = unittest.TextTestRunner(stream=sys.stdout, verbosity=2)
    result = unittest.main(module=sys.modules[__name__], argv=[sys.argv[0]] + rest, testRunner=runner,
                           exit=False).result
    sys.stdout.write("\nanthropic client tests: %s in %.1fs (ran %d)\n" % (
        "PASS" if result.wasSuccessful() else "FAIL", time.monotonic() - started, result.testsRun))
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
