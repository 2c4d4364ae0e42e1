"""Self-distillation data written entirely by the target: it invents the instructions and answers them.

Instructions: the target is given only the user header of its chat template (system turn, `<|im_start|>user\\n`)
and samples what a user would write (temperature 1, nucleus 0.95), up to `--instruction-tokens`. Kept: those that
end with the end-of-turn token, hold no other turn marker, have 4 tokens or more, and are new (compared lowercased,
whitespace folded). Answers: the target's greedy reply to each kept instruction, up to `--max-new-tokens`.

Generation runs in bf16 (the answers are plausible target text; the drafter's labels are recomputed by the fp32
target at training time), left-padded, instructions sorted by length so a batch pads little. Both phases are
bounded by wall clock (`--budget-s`; the instruction phase gets `--instruction-share` of it).

Output: the same `.npz` layout as an MTP run's `train_data.npz` (tokens, lens, prompt_lens, heldout, sampled, conv,
kind), so `train_dflash.py --data a.npz,b.npz` reads both. Held-out split by a hash of the instruction text (5 %).

    python3 tools/train/self_instruct.py --gguf G --out self_instruct.npz --budget-s 280

The same data can be written by a running `verity serve` of the target (`--server`: no GPU, no torch; the answers
are then the quantized target's own greedy text), as instruction/answer texts appended to a JSONL file (`--texts`,
resumed where it stopped: instructions already there are not written again), and packed into the `.npz` later
where torch and transformers are installed (`--texts` without `--server`):

    python3 tools/train/self_instruct.py --server http://127.0.0.1:8090 --gguf G --texts si.jsonl --budget-s 5400
    python3 tools/train/self_instruct.py --gguf G --texts si.jsonl --out self_instruct.npz

With `--leads FILE` (server mode), each instruction starts with a line of FILE drawn at random (an opening such as
"Fix the bug in this JavaScript function:"), which the target continues: instructions from the header alone stay
close to the few kinds of request a 135M model imagines, and a drafter trained on their answers learns that style
more than the target (`runs/2026-12-07-h100-drafter-v3/`). `leads.txt` holds generic task openings across code,
editing, explanation and writing; never the benchmark prompts.
"""

import argparse
import hashlib
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def dedup_key(text):
    """Instructions that differ only in case or whitespace are one."""
    return " ".join(text.lower().split())


def heldout(text, frac=0.05):
    return int(hashlib.sha256(("heldout:" + text).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def user_header(tok):
    """The chat template's tokens up to where a user's words begin."""
    marker = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=False)
    return tok(text[: text.index(marker)], add_special_tokens=False).input_ids


def sample_instructions(model, tok, eos, args, deadline, log):
    """Instructions the target writes, deduplicated, until `args.instructions` or the deadline."""
    import torch

    head = user_header(tok)
    turn_start = tok.convert_tokens_to_ids("<|im_start|>")
    seen, out, batches = set(), [], 0
    while len(out) < args.instructions and time.time() < deadline:
        ids = torch.tensor([head] * args.instruction_batch, device=model.device)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.instruction_tokens,
                                 do_sample=True, temperature=1.0, top_p=0.95, top_k=0, pad_token_id=eos,
                                 eos_token_id=eos)
        batches += 1
        for row in gen[:, len(head):].tolist():
            if eos not in row:
                continue
            row = row[: row.index(eos)]
            if len(row) < 4 or turn_start in row:
                continue
            text = tok.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()
            key = dedup_key(text)
            if not key or key in seen:
                continue
            seen.add(key)
            out.append(text)
        log(f"instructions: batch {batches}, {len(out)} kept")
    return out[: args.instructions]


def template_header(gguf_path):
    """The GGUF chat template's text up to where a user's words begin (rendered as the server renders it)."""
    import gguf
    import jinja2

    f = gguf.GGUFReader(gguf_path).fields["tokenizer.chat_template"]
    template = jinja2.Environment().from_string(bytes(f.parts[f.data[0]]).decode())
    marker = "\x00MARK\x00"
    text = template.render(messages=[{"role": "user", "content": marker}], add_generation_prompt=False)
    return text[: text.index(marker)]


def post(url, body):
    """The server's JSON answer; a 503 (its queue is full) is retried after a pause, any other failure raised."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    while True:
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise
            time.sleep(0.5)


def serve_texts(args):
    """Instructions and greedy answers from a running `verity serve`, appended to `args.texts` by `args.clients`
    threads until the budget or `args.instructions` pairs: each thread samples an instruction from the template's
    user header (kept as the torch path keeps them: ended by the end-of-turn token, 4 tokens or more, no turn
    marker, new), then asks for its greedy answer."""
    head = template_header(args.gguf)
    leads = [""]
    if args.leads:
        with open(args.leads) as f:
            leads = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    seen = set()
    if os.path.exists(args.texts):
        with open(args.texts) as f:
            seen = {dedup_key(json.loads(line)["instruction"]) for line in f if line.strip()}
    lock, out, t0 = threading.Lock(), open(args.texts, "a"), time.time()
    rng = random.Random(args.seed + len(seen))
    counts = {"sampled": 0, "kept": len(seen)}
    failed = []  # the first error of any thread stops them all

    def work():
        try:
            draw()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            with lock:
                failed.append(e)

    def draw():
        while time.time() - t0 < args.budget_s:
            with lock:
                if failed or counts["kept"] >= args.instructions:
                    return
                seed = rng.getrandbits(31)
                lead = rng.choice(leads)
            r = post(args.server + "/v1/completions", {
                "prompt": head + lead, "max_tokens": args.instruction_tokens, "temperature": 1.0, "top_p": 0.95,
                "seed": seed})
            c = r["choices"][0]
            text = (lead + c["text"]).strip()
            key = dedup_key(text)
            with lock:
                counts["sampled"] += 1
                if (c["finish_reason"] != "stop" or r["usage"]["completion_tokens"] < 4 or "<|im_start|>" in text
                        or not key or key in seen):
                    continue
                seen.add(key)
            a = post(args.server + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": text}], "max_tokens": args.max_new_tokens,
                "temperature": 0})["choices"][0]
            with lock:
                out.write(json.dumps({"instruction": text, "answer": a["message"]["content"],
                                      "finish_reason": a["finish_reason"]}) + "\n")
                out.flush()
                counts["kept"] += 1
                if counts["kept"] % 100 == 0:
                    print(f"[{time.time() - t0:7.0f}s] {counts['kept']} pairs ({counts['sampled']} instructions "
                          "sampled)", flush=True)

    threads = [threading.Thread(target=work) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.close()
    print(f"{counts['kept']} pairs in {args.texts} after {time.time() - t0:.0f}s", flush=True)
    if failed:
        raise SystemExit(f"stopped by a failed request: {failed[0]!r}")


def write_npz(path, prompts, answers, instructions):
    """The MTP run's `.npz` layout: prompt + answer tokens per conversation, in instruction order."""
    tokens = [np.asarray(p + a, dtype=np.int32) for p, a in zip(prompts, answers)]
    np.savez_compressed(
        path,
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        lens=np.array([len(t) for t in tokens], np.int32),
        prompt_lens=np.array([len(p) for p in prompts], np.int32),
        heldout=np.array([heldout(s) for s in instructions], bool),
        sampled=np.zeros(len(tokens), bool),
        conv=np.array(["si" + hashlib.sha256(s.encode()).hexdigest()[:11] for s in instructions]),
        kind=np.array(["self_instruct"] * len(tokens)))
    return sum(len(t) for t in tokens)


def chat_prompt(tok, instruction):
    return tok(tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False).input_ids


def pack_texts(args):
    """`--texts` (from `serve_texts`) tokenized by the target's tokenizer into the `.npz`; an answer the server
    ended at the end-of-turn token gets that token, as the torch path's answers keep it (transformers reads the
    GGUF's tokenizer with torch installed: the training machine)."""
    import gguf
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    eos = int(gguf.GGUFReader(args.gguf).fields["tokenizer.ggml.eos_token_id"].contents())
    with open(args.texts) as f:
        pairs = [json.loads(line) for line in f if line.strip()]
    prompts = [chat_prompt(tok, p["instruction"]) for p in pairs]
    answers = [tok(p["answer"], add_special_tokens=False).input_ids + ([eos] if p["finish_reason"] == "stop" else [])
               for p in pairs]
    n = write_npz(args.out, prompts, answers, [p["instruction"] for p in pairs])
    print(f"wrote {len(pairs)} conversations ({n} tokens) to {args.out}", flush=True)


def torch_data(args):
    import torch
    from train_mtp import gguf_config, generate_batch, load_target, log, seed_all

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seed_all(args.seed)
    t0 = time.time()
    gcfg = gguf_config(args.gguf)
    tok, model = load_target(args.gguf, device)
    if device == "cuda":
        model.to(torch.bfloat16)
    eos = gcfg["eos"]
    instructions = sample_instructions(model, tok, eos, args, t0 + args.budget_s * args.instruction_share, log)
    log(f"{len(instructions)} instructions in {time.time() - t0:.1f}s")

    prompts = [chat_prompt(tok, s) for s in instructions]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = []
    for s in range(0, len(order), args.answer_batch):
        if time.time() - t0 > args.budget_s:
            log(f"answers: stopped by the budget after {s} of {len(order)}")
            break
        chunk = order[s:s + args.answer_batch]
        t = time.time()
        answers = generate_batch(model, [prompts[i] for i in chunk], eos, args.max_new_tokens, device)
        rows += [(i, a) for i, a in zip(chunk, answers)]
        log(f"answers: batch of {len(chunk)}, mean {np.mean([len(a) for a in answers]):.0f} tokens, "
            f"{time.time() - t:.1f}s")
    rows.sort()
    n = write_npz(args.out, [prompts[i] for i, _ in rows], [a for _, a in rows], [instructions[i] for i, _ in rows])
    log(f"wrote {len(rows)} conversations ({n} tokens) to {args.out} in {time.time() - t0:.1f}s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", help="the .npz to write (torch generation, or packing --texts)")
    p.add_argument("--texts", help="instruction/answer JSONL: written with --server, packed into --out without")
    p.add_argument("--server", help="a running `verity serve` of the target, e.g. http://127.0.0.1:8090")
    p.add_argument("--clients", type=int, default=16, help="with --server: requests in flight")
    p.add_argument("--leads", help="with --server: openings (a line each; \\n a newline) the sampled instructions "
                   "start with")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--instructions", type=int, default=40000, help="at most this many instructions")
    p.add_argument("--instruction-tokens", type=int, default=96)
    p.add_argument("--instruction-batch", type=int, default=2048)
    p.add_argument("--instruction-share", type=float, default=0.3,
                   help="of the budget, for writing instructions (on an H100: ~130 kept a second, ~50 answers a second)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--answer-batch", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=280)
    args = p.parse_args()
    if args.server:
        if not args.texts:
            p.error("--server writes --texts")
        serve_texts(args)
    elif args.texts:
        if not args.out:
            p.error("packing --texts needs --out")
        pack_texts(args)
    elif args.out:
        torch_data(args)
    else:
        p.error("give --out (torch generation), --server with --texts, or --texts with --out")


if __name__ == "__main__":
    main()
