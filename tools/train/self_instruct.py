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
"""

import argparse
import hashlib
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_mtp import gguf_config, generate_batch, load_target, log, seed_all  # noqa: E402


def heldout(text, frac=0.05):
    return int(hashlib.sha256(("heldout:" + text).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def user_header(tok):
    """The chat template's tokens up to where a user's words begin."""
    marker = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=False)
    return tok(text[: text.index(marker)], add_special_tokens=False).input_ids


@torch.no_grad()
def sample_instructions(model, tok, eos, args, deadline):
    """Instructions the target writes, deduplicated, until `args.instructions` or the deadline."""
    head = user_header(tok)
    turn_start = tok.convert_tokens_to_ids("<|im_start|>")
    seen, out, batches = set(), [], 0
    while len(out) < args.instructions and time.time() < deadline:
        ids = torch.tensor([head] * args.instruction_batch, device=model.device)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.instruction_tokens,
                             do_sample=True, temperature=1.0, top_p=0.95, top_k=0, pad_token_id=eos, eos_token_id=eos)
        batches += 1
        for row in gen[:, len(head):].tolist():
            if eos not in row:
                continue
            row = row[: row.index(eos)]
            if len(row) < 4 or turn_start in row:
                continue
            text = tok.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()
            key = " ".join(text.lower().split())
            if not key or key in seen:
                continue
            seen.add(key)
            out.append(text)
        log(f"instructions: batch {batches}, {len(out)} kept")
    return out[: args.instructions]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
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

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seed_all(args.seed)
    t0 = time.time()
    gcfg = gguf_config(args.gguf)
    tok, model = load_target(args.gguf, device)
    if device == "cuda":
        model.to(torch.bfloat16)
    eos = gcfg["eos"]
    instructions = sample_instructions(model, tok, eos, args, t0 + args.budget_s * args.instruction_share)
    log(f"{len(instructions)} instructions in {time.time() - t0:.1f}s")

    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": s}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for s in instructions]
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
    tokens = [np.asarray(prompts[i] + a, dtype=np.int32) for i, a in rows]
    np.savez_compressed(
        args.out,
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        lens=np.array([len(t) for t in tokens], np.int32),
        prompt_lens=np.array([len(prompts[i]) for i, _ in rows], np.int32),
        heldout=np.array([heldout(instructions[i]) for i, _ in rows], bool),
        sampled=np.zeros(len(rows), bool),
        conv=np.array(["si" + hashlib.sha256(instructions[i].encode()).hexdigest()[:11] for i, _ in rows]),
        kind=np.array(["self_instruct"] * len(rows)))
    log(f"wrote {len(rows)} conversations ({sum(len(t) for t in tokens)} tokens) to {args.out} "
        f"in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
