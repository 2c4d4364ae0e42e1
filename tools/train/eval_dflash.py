"""Evaluate an exported block drafter (a bundle's `drafter/` folder) on texts other than its training data:
the answers AR gave in a `verity bench speed --json` record file, under the evaluation `train_dflash.py` runs on
its held-out conversations (every answer position an anchor; greedy drafts against the target's greedy tokens,
teacher-forced; tokens per cycle and acceptance by row). Tells how much of a gap between the training's held-out
figure and the tokens per cycle verity measures comes from the texts, and how much from the runtime.

    python3 tools/train/eval_dflash.py --gguf G --drafter BUNDLE/drafter --records speed.json \\
        --prompts bench/prompts.jsonl

Only first turns are used (a second turn's prompt holds the first answer, which the record does not tokenize as
the runtime did). CPU by default (`--device cuda` where there is one).
"""

import argparse
import json
import os
import sys
import tempfile
import types

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import self_instruct  # noqa: E402
from dflash_drafter import BlockDrafter, DrafterConfig  # noqa: E402
from train_dflash import Sequences, evaluate  # noqa: E402
from train_mtp import load_target  # noqa: E402


def first_turns(records, prompts, max_tokens):
    """(instruction, answer, finish) of each prompt's first-turn AR answer, first repeat; `finish` "stop" where the
    answer ended before the token limit."""
    out = []
    for r in records:
        if r["route"] != "ar" or r["turn"] != 1 or r["repeat"] != 0:
            continue
        p = prompts[r["prompt_id"]]
        messages = p.get("messages") or p["turns"]
        out.append({"instruction": messages[0]["content"], "answer": r["text"],
                    "finish_reason": "stop" if r["completion_tokens"] < max_tokens else "length",
                    "category": r["category"]})
    return out


def load_drafter(folder, device):
    from safetensors.torch import load_file
    cj = json.load(open(os.path.join(folder, "config.json")))
    d = cj["dflash_config"]
    cfg = DrafterConfig(hidden=cj["hidden_size"], layers=cj["num_hidden_layers"], n_heads=cj["num_attention_heads"],
                        n_kv_heads=cj["num_key_value_heads"], head_dim=cj["head_dim"],
                        ffn=cj["intermediate_size"], eps=cj["rms_norm_eps"], rope_theta=cj["rope_theta"],
                        vocab=cj["vocab_size"], target_layers=d["target_layer_ids"], block=d["block_size"],
                        mask_token=d["mask_token_id"])
    weights = load_file(os.path.join(folder, "model.safetensors"))
    dv = weights.pop("draft_vocab", None)
    drafter = BlockDrafter(cfg)
    drafter.load_state_dict_hf(weights)
    return drafter.to(device).eval(), cfg, None if dv is None else dv.long().to(device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="the target (the drafter's training target)")
    p.add_argument("--drafter", required=True, help="the drafter folder (config.json, model.safetensors)")
    p.add_argument("--records", required=True, help="`verity bench speed --json` records holding the ar route")
    p.add_argument("--prompts", default="bench/prompts.jsonl", help="the prompt file those records ran")
    p.add_argument("--max-tokens", type=int, default=256, help="the run's --max-tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-len", type=int, default=768)
    args = p.parse_args()

    prompts = {}
    with open(args.prompts) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                prompts[rec["id"]] = rec
    texts = first_turns(json.load(open(args.records)), prompts, args.max_tokens)
    if not texts:
        raise SystemExit(f"{args.records}: no first-turn ar records")
    drafter, cfg, dv = load_drafter(args.drafter, args.device)
    _, model = load_target(args.gguf, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, npz = os.path.join(tmp, "texts.jsonl"), os.path.join(tmp, "texts.npz")
        by_category = {}
        for t in texts:
            by_category.setdefault(t["category"], []).append(t)
        results = {}
        for category, items in sorted(by_category.items()):
            with open(jsonl, "w") as f:
                f.writelines(json.dumps(t) + "\n" for t in items)
            self_instruct.pack_texts(types.SimpleNamespace(gguf=args.gguf, texts=jsonl, out=npz))
            z = dict(np.load(npz))
            z["heldout"] = np.ones_like(z["heldout"])  # every sequence is evaluated
            np.savez(npz, **z)
            seqs = Sequences(npz)
            with torch.no_grad():
                results[category] = evaluate(drafter, model, seqs, cfg, args.device, len(seqs.held), args.max_len, dv)
    results["all"] = pooled(results.values())
    for category, m in results.items():
        print(f"{category:12s} {m['blocks']:5d} anchors: {m['tokens_per_cycle']:.3f} tokens/cycle, "
              f"accepted by row {m['accepted_by_row'][:4]}", flush=True)
    print(json.dumps(results))


def pooled(parts):
    """`evaluate`'s figures over the anchors of all `parts` (each weighted by its anchors)."""
    parts = list(parts)
    blocks = sum(p["blocks"] for p in parts)
    accepted = sum(p["accepted_per_block"] * p["blocks"] for p in parts) / max(1, blocks)
    rows = len(parts[0]["accepted_by_row"])
    by_row = [round(sum(p["accepted_by_row"][i] * p["blocks"] for p in parts) / max(1, blocks), 4) for i in range(rows)]
    return {"blocks": blocks, "accepted_per_block": accepted, "tokens_per_cycle": 1.0 + accepted,
            "accepted_by_row": by_row}


if __name__ == "__main__":
    main()
