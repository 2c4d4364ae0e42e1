#!/usr/bin/env python3
"""Side-by-side AR greedy decode benchmark: verity vs. published peers.

Arms (pick with --arms, comma separated):
  verity-ar  our engine, through its CLI (`verity bench speed --routes ar`), one subprocess per run
  llama.cpp  llama-cpp-python, in-process (GGUF chat template, greedy, token-level streaming)
  mistralrs  mistralrs from PyPI, in-process (GGUF chat template, greedy, streaming)

Runs are interleaved per prompt and repeat (A B C A B C ...) so that drift of the machine hits all
arms alike. One record per prompt x arm x repeat, in the same shape as `verity bench speed --json`.
See bench/peers/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

DEFAULT_PROMPTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "prompts.jsonl"))
DEFAULT_MODEL = "/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_ARMS = ("verity-ar", "llama.cpp", "mistralrs")
ARM_ALIASES = {"verity": "verity-ar", "ar": "verity-ar", "llama": "llama.cpp", "llamacpp": "llama.cpp",
               "llama-cpp": "llama.cpp", "mistral.rs": "mistralrs", "mistral": "mistralrs"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_record(prompt: dict, arm: str, repeat: int, *, prompt_tokens: int, completion_tokens: int,
                ttft_s: float, decode_s: float, text: str, engine_version: str) -> dict:
    decode_tok_s = (completion_tokens - 1) / decode_s if completion_tokens > 1 and decode_s > 0 else 0.0
    return {
        "prompt_id": prompt["id"],
        "category": prompt.get("category", ""),
        "turn": 1,
        "route": arm,
        "repeat": repeat,
        "prompt_tokens": prompt_tokens,
        "restored_tokens": 0,
        "completion_tokens": completion_tokens,
        "ttft_s": ttft_s,
        "decode_tok_s": decode_tok_s,
        "cycles": completion_tokens,
        "accepted_per_cycle": 1.0,
        "verify_rows": completion_tokens,
        "draft_s": 0.0,
        "verify_s": 0.0,
        "other_s": 0.0,
        "text": text,
        "engine_version": engine_version,
    }


# --------------------------------------------------------------------------------------------------
# verity (subprocess, CLI contract of `verity bench speed`)
# --------------------------------------------------------------------------------------------------
class VerityArm:
    name = "verity-ar"

    def __init__(self, binary: str, model: str, threads: int, max_tokens: int, timeout_s: float,
                 gpu: bool = False):
        resolved = binary if os.path.sep in binary else shutil.which(binary)
        if not resolved or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
            raise SystemExit(
                f"error: verity binary not found or not executable: {binary!r}\n"
                f"  build it with `cargo build --release` (expected at target/release/verity), pass --verity PATH,\n"
                f"  or leave the verity arm out with --arms llama.cpp,mistralrs")
        self.binary = os.path.abspath(resolved)
        self.model, self.threads, self.max_tokens, self.timeout_s = model, threads, max_tokens, timeout_s
        self.device = ["--device", "cuda"] if gpu else ["--device", "cpu"]
        self.tmpdir = tempfile.mkdtemp(prefix="verity-peers-")
        self.version = self._version()

    def _version(self) -> str:
        try:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30)
            v = (out.stdout or out.stderr).strip().splitlines()
            if out.returncode == 0 and v:
                return v[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
        return "verity (unknown version)"

    def warmup(self, prompt: dict) -> None:
        # Each run is a fresh process (model load is outside the timed region); nothing to warm.
        pass

    def run(self, prompt: dict, repeat: int) -> dict:
        pfile = os.path.join(self.tmpdir, "prompt.jsonl")
        ofile = os.path.join(self.tmpdir, "out.json")
        with open(pfile, "w", encoding="utf-8") as f:
            f.write(json.dumps(prompt, ensure_ascii=False) + "\n")
        if os.path.exists(ofile):
            os.remove(ofile)
        cmd = [self.binary, "--threads", str(self.threads), *self.device, "bench", "speed", "--model", self.model,
               "--routes", "ar", "--prompts", pfile, "--max-tokens", str(self.max_tokens),
               "--temperature", "0", "--repeat", "1", "--json", ofile]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"verity timed out after {self.timeout_s}s: {' '.join(cmd)}")
        if proc.returncode != 0:
            raise RuntimeError(f"verity exited {proc.returncode}: {' '.join(cmd)}\n"
                               f"--- stderr (tail) ---\n{proc.stderr[-4000:]}")
        if not os.path.exists(ofile):
            raise RuntimeError(f"verity wrote no JSON to {ofile}: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        recs = read_records(ofile)
        recs = [r for r in recs if r.get("prompt_id") == prompt["id"] and r.get("route", "ar") == "ar"
                and int(r.get("turn", 1)) == 1]
        if len(recs) != 1:
            raise RuntimeError(f"expected exactly one ar/turn-1 record for {prompt['id']} in {ofile}, got {len(recs)}")
        rec = dict(recs[0])
        rec["route"] = self.name
        rec["repeat"] = repeat
        rec["category"] = rec.get("category") or prompt.get("category", "")
        rec.setdefault("engine_version", self.version)
        for k in ("restored_tokens", "draft_s", "verify_s", "other_s"):
            rec.setdefault(k, 0)
        return rec

    def close(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        data = f.read().strip()
    if not data:
        return []
    try:
        obj = json.loads(data)
        if isinstance(obj, list):
            return obj
        if isinstance(obj, dict):
            return obj.get("records", [obj]) if "records" in obj else [obj]
    except json.JSONDecodeError:
        pass
    return [json.loads(line) for line in data.splitlines() if line.strip()]  # JSON lines


# --------------------------------------------------------------------------------------------------
# llama.cpp (llama-cpp-python, in-process)
# --------------------------------------------------------------------------------------------------
class LlamaCppArm:
    name = "llama.cpp"

    def __init__(self, model: str, threads: int, max_tokens: int, gpu: bool = False, flash_attn: bool = False):
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.version = f"llama-cpp-python {llama_cpp.__version__}" + (" (CUDA, all layers on the GPU)" if gpu else "")
        if flash_attn:
            self.version += " (flash attention)"
        self.max_tokens = max_tokens
        self.llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                         n_gpu_layers=-1 if gpu else 0, flash_attn=flash_attn, verbose=False)
        meta = self.llm.metadata
        template = meta.get("tokenizer.chat_template")

        def tok_str(key: str) -> str:
            tid = meta.get(key)
            return self.llm._model.token_get_text(int(tid)) if tid is not None else ""

        eos, bos = tok_str("tokenizer.ggml.eos_token_id"), tok_str("tokenizer.ggml.bos_token_id")
        # A base model (no template) takes raw-text prompts only.
        self.formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos) if template else None
        # End-of-generation tokens as llama.cpp defines them (EOS, EOT, <|im_end|>, ...).
        vocab = self.llm._model.vocab
        self.eog = {t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}

    def prompt_tokens(self, prompt: dict) -> list[int]:
        # add_bos=True lets llama.cpp add BOS only if the GGUF asks for it (tokenizer.ggml.add_bos_token).
        if "prompt" in prompt:  # raw text, as verity tokenizes it: no control tokens inside
            return self.llm.tokenize(prompt["prompt"].encode("utf-8"), add_bos=True, special=False)
        if self.formatter is None:
            raise SystemExit(f"error: {prompt['id']} is a chat prompt but the GGUF has no tokenizer.chat_template")
        rendered = self.formatter(messages=prompt["messages"]).prompt
        return self.llm.tokenize(rendered.encode("utf-8"), add_bos=True, special=True)

    def _generate(self, tokens: list[int], max_tokens: int):
        self.llm.reset()  # n_tokens = 0: no reuse of the previous run's KV cache (full prefill every run)
        t0 = time.perf_counter()
        t_first = t_last = None
        out: list[int] = []
        for tok in self.llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            now = time.perf_counter()
            if tok in self.eog:
                break
            if t_first is None:
                t_first = now
            t_last = now
            out.append(tok)
            if len(out) >= max_tokens:
                break
        if t_first is None:
            t_first = t_last = time.perf_counter()
        return out, t_first - t0, t_last - t_first

    def warmup(self, prompt: dict) -> None:
        self._generate(self.prompt_tokens(prompt), 8)

    def run(self, prompt: dict, repeat: int) -> dict:
        tokens = self.prompt_tokens(prompt)
        out, ttft, decode_s = self._generate(tokens, self.max_tokens)
        text = self.llm.detokenize(out).decode("utf-8", errors="replace")
        return make_record(prompt, self.name, repeat, prompt_tokens=len(tokens), completion_tokens=len(out),
                           ttft_s=ttft, decode_s=decode_s, text=text, engine_version=self.version)

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None


# --------------------------------------------------------------------------------------------------
# mistral.rs (mistralrs from PyPI, in-process)
# --------------------------------------------------------------------------------------------------
class MistralRsArm:
    name = "mistralrs"

    def __init__(self, model: str, threads: int, max_tokens: int):
        # mistral.rs (candle) parallelises with rayon; the pool size is read once, at first use.
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        import importlib.metadata as md
        from mistralrs import Runner, Which

        self.version = f"mistralrs {md.version('mistralrs')}"
        self.max_tokens = max_tokens
        # prefix_cache_n=0: no prefix reuse across repeats (full prefill every run, like the other arms).
        self.runner = Runner(
            which=Which.GGUF(quantized_model_id=os.path.dirname(os.path.abspath(model)),
                             quantized_filename=os.path.basename(model)),
            token_source="none", prefix_cache_n=0, max_seqs=1)

    def _generate(self, prompt: dict, max_tokens: int):
        from mistralrs import ChatCompletionRequest

        req = ChatCompletionRequest(model="default", messages=prompt["messages"], max_tokens=max_tokens,
                                    temperature=0.0, top_k=1, top_p=1.0, stream=True)
        t0 = time.perf_counter()
        t_first = t_last = None
        parts: list[str] = []
        usage = None
        for chunk in self.runner.send_chat_completion_request(req):
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                delta = ch.delta.content if ch.delta is not None else None
                if delta:
                    if t_first is None:
                        t_first = now
                    t_last = now
                    parts.append(delta)
        if t_first is None:
            t_first = t_last = time.perf_counter()
        return "".join(parts), usage, t_first - t0, t_last - t_first

    def warmup(self, prompt: dict) -> None:
        self._generate(prompt, 8)

    def run(self, prompt: dict, repeat: int) -> dict:
        text, usage, ttft, decode_s = self._generate(prompt, self.max_tokens)
        prompt_tokens = usage.prompt_tokens if usage is not None else -1
        completion = usage.completion_tokens if usage is not None else -1
        return make_record(prompt, self.name, repeat, prompt_tokens=prompt_tokens, completion_tokens=completion,
                           ttft_s=ttft, decode_s=decode_s, text=text, engine_version=self.version)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def summarize(records: list[dict], arms: list[str], versions: dict[str, str], threads: int, max_tokens: int) -> str:
    cats = []
    for r in records:
        if r["category"] not in cats:
            cats.append(r["category"])
    by = defaultdict(list)  # (arm, category) -> records
    per_prompt = defaultdict(lambda: defaultdict(list))  # arm -> prompt_id -> tok/s
    prompt_cat = {}
    for r in records:
        by[(r["route"], r["category"])].append(r)
        by[(r["route"], "ALL")].append(r)
        per_prompt[r["route"]][r["prompt_id"]].append(r["decode_tok_s"])
        prompt_cat[r["prompt_id"]] = r["category"]
    cats_all = cats + ["ALL"]
    lines = [f"\n== AR greedy decode, {threads} threads, max {max_tokens} tokens "
             f"(medians over prompts x repeats) =="]
    w = max(10, *(len(c) for c in cats_all))
    lines.append(f"{'arm':<10} {'category':<{w}} {'n':>3} {'tok/s':>8} {'ttft_ms':>8} {'tokens':>6}")
    for arm in arms:
        for c in cats_all:
            rs = by.get((arm, c), [])
            if not rs:
                continue
            lines.append(f"{arm:<10} {c:<{w}} {len(rs):>3} {median([r['decode_tok_s'] for r in rs]):>8.1f} "
                         f"{1000 * median([r['ttft_s'] for r in rs]):>8.1f} "
                         f"{median([r['completion_tokens'] for r in rs]):>6.0f}")
    ref = "verity-ar" if "verity-ar" in arms else arms[0]
    others = [a for a in arms if a != ref]
    if others:
        lines.append(f"\n{ref} / peer decode tok/s (median over prompts of per-prompt median ratios):")
        lines.append(f"{'category':<{w}} " + " ".join(f"{'vs ' + a:>14}" for a in others))
        for c in cats_all:
            cells = []
            for a in others:
                ratios = []
                for pid, vals in per_prompt[ref].items():
                    if c != "ALL" and prompt_cat[pid] != c:
                        continue
                    peer = per_prompt[a].get(pid)
                    if peer and median(peer) > 0:
                        ratios.append(median(vals) / median(peer))
                cells.append(f"{median(ratios):>14.2f}" if ratios else f"{'-':>14}")
            lines.append(f"{c:<{w}} " + " ".join(cells))
        # Greedy outputs should agree closely; a cheap sanity check on the engines (first repeat only).
        # (Different kernels round differently, so long greedy outputs may part ways after a while.)
        parts = []
        for a in others:
            pids = [pid for pid in per_prompt[ref] if _text(records, a, pid) is not None]
            same = sum(1 for pid in pids if _text(records, a, pid) == _text(records, ref, pid))
            common = [_common_prefix(_text(records, a, pid), _text(records, ref, pid)) for pid in pids]
            parts.append(f"{a} identical {same}/{len(pids)}, median common prefix {median(common):.0f} chars")
        lines.append(f"\ngreedy text vs {ref} (repeat 0): " + "; ".join(parts))
    lines.append("\nversions: " + "; ".join(f"{a}: {versions[a]}" for a in arms))
    return "\n".join(lines)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a or "", b or ""):
        if x != y:
            break
        n += 1
    return n


def _text(records, arm, pid):
    for r in records:
        if r["route"] == arm and r["prompt_id"] == pid and r["repeat"] == 0:
            return r["text"]
    return None


# --------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ALL_ARMS),
                    help="comma-separated subset of: " + ", ".join(ALL_ARMS))
    ap.add_argument("--verity", default="target/release/verity", help="path of the verity binary")
    ap.add_argument("--verity-timeout", type=float, default=600.0, help="seconds per verity subprocess")
    ap.add_argument("--only", default="", help="comma-separated prompt ids or categories to keep")
    ap.add_argument("--gpu", action="store_true",
                    help="run on the GPU: verity with --device cuda, llama.cpp with every layer offloaded")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    ap.add_argument("--json", dest="json_out", default="", help="write the records here (a JSON list)")
    args = ap.parse_args()

    arms = []
    for a in (x.strip() for x in args.arms.split(",") if x.strip()):
        a = ARM_ALIASES.get(a.lower(), a)
        if a not in ALL_ARMS:
            ap.error(f"unknown arm {a!r}; choose from {', '.join(ALL_ARMS)}")
        if a not in arms:
            arms.append(a)
    if not arms:
        ap.error("no arms")
    if not os.path.isfile(args.model):
        ap.error(f"model not found: {args.model}")

    prompts, skipped = [], 0
    only = {x for x in args.only.split(",") if x}
    with open(args.prompts, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            if "messages" not in p and "prompt" not in p:  # multi-turn `turns` prompts are not run for peers
                skipped += 1
                continue
            if only and p["id"] not in only and p.get("category") not in only:
                continue
            prompts.append(p)
    if not prompts:
        ap.error("no single-turn (`messages` or raw `prompt`) prompts selected")
    log(f"{len(prompts)} prompts ({skipped} multi-turn skipped), arms {arms}, threads {args.threads}, "
        f"max_tokens {args.max_tokens}, repeat {args.repeat}")

    runners = {}
    # verity first: a missing binary should fail before minutes of peer model loading.
    if "verity-ar" in arms:
        runners["verity-ar"] = VerityArm(args.verity, args.model, args.threads, args.max_tokens, args.verity_timeout,
                                          gpu=args.gpu)
    for a in arms:
        if a == "llama.cpp":
            try:
                runners[a] = LlamaCppArm(args.model, args.threads, args.max_tokens, gpu=args.gpu,
                                         flash_attn=args.flash_attn)
            except ImportError as e:
                raise SystemExit(f"error: llama.cpp arm needs llama-cpp-python ({e}); see bench/peers/README.md")
        elif a == "mistralrs":
            try:
                runners[a] = MistralRsArm(args.model, args.threads, args.max_tokens)
            except ImportError as e:
                raise SystemExit(f"error: mistralrs arm needs the mistralrs package ({e}); see bench/peers/README.md")
    versions = {a: runners[a].version for a in arms}
    for a in arms:
        log(f"{a}: {versions[a]}")
        runners[a].warmup(prompts[0])

    records = []
    try:
        for rep in range(args.repeat):
            for p in prompts:
                for a in arms:  # interleaved: A B C A B C ...
                    rec = runners[a].run(p, rep)
                    records.append(rec)
                    log(f"rep {rep} {p['id']:<14} {a:<10} prompt {rec['prompt_tokens']:>4} "
                        f"gen {rec['completion_tokens']:>4} ttft {1000 * rec['ttft_s']:7.1f} ms "
                        f"decode {rec['decode_tok_s']:7.1f} tok/s")
    finally:
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(records, f, ensure_ascii=False, indent=1)
            log(f"wrote {len(records)} records to {args.json_out}")
        for r in runners.values():
            r.close()

    print(summarize(records, arms, versions, args.threads, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
