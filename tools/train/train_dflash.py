"""Train a block drafter (DFlash layout) for SmolLM2-135M-Instruct by self-distillation, evaluate its acceptance
under greedy block drafting, and export it as a bundle's `drafter/` folder (config.json + model.safetensors).

Data: the target's own answers, never the benchmark prompts: the conversations of an MTP run
(`runs/2026-12-02-h100/train_data.npz`: templated instructions, greedy and sampled) and those of
`self_instruct.py` (instructions the target wrote itself); `--data` takes several files, comma-separated. For each batch of sequences the
target runs once (frozen, fp32) and yields the residual streams after the drafter's target layers (forward hooks
on those layers: the states verity's runtime fuses) and its greedy next token at every position.

Training: in every sequence, `--anchors` positions of the answer are drawn; the block at anchor a is
[t_a, mask, ...] and sees the context positions < a; row i's label is the target's greedy token at a + i given the
data prefix. Loss: cross-entropy per row, weighted exp(-(i-1)/gamma) (early rows decide acceptance).
Evaluation (held-out sequences, every answer position as an anchor): the greedy drafts' accepted length against
the target's greedy tokens, per row, and tokens per cycle (accepted + 1).

    python3 tools/train/train_dflash.py --gguf G --data tools/train/runs/2026-12-02-h100/train_data.npz --out OUT
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_drafter import BlockDrafter, DrafterConfig  # noqa: E402
from train_mtp import gguf_config, load_target, log, seed_all, sha256_file  # noqa: E402


# Anchors per held-out sequence at evaluation (evenly spaced over its answer).
EVAL_ANCHORS = 128


class Sequences:
    """The data's conversations (token lists with their prompt length), split into training and held-out."""

    def __init__(self, paths):
        self.seqs, held = [], []
        for path in paths.split(","):
            with np.load(path) as z:  # read each array once (NpzFile decompresses on every access)
                d = {k: z[k] for k in ("tokens", "lens", "prompt_lens", "heldout")}
            offs = np.concatenate([[0], np.cumsum(d["lens"])[:-1]])
            self.seqs += [(d["tokens"][o:o + n].astype(np.int64), int(p))
                          for o, n, p in zip(offs, d["lens"], d["prompt_lens"])]
            held += d["heldout"].astype(bool).tolist()
        self.train = [i for i in range(len(self.seqs)) if not held[i] and self.seqs[i][0].size - self.seqs[i][1] > 2]
        self.held = [i for i in range(len(self.seqs)) if held[i] and self.seqs[i][0].size - self.seqs[i][1] > 2]


@torch.no_grad()
def target_pass(model, idx, seqs, layers, device, max_len):
    """Right-padded tokens [B, T], valid [B, T], the states after `layers` [B, T, n·h] and the target's greedy
    next token at each position [B, T]."""
    rows = [seqs.seqs[i][0][:max_len] for i in idx]
    T = max(len(r) for r in rows)
    tok = torch.full((len(rows), T), 2, dtype=torch.long)
    valid = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        tok[b, :len(r)] = torch.from_numpy(r)
        valid[b, :len(r)] = True
    tok, valid = tok.to(device), valid.to(device)
    captured = {}
    hooks = [model.model.layers[l].register_forward_hook(
        lambda _m, _i, out, l=l: captured.__setitem__(l, out[0] if isinstance(out, tuple) else out))
        for l in layers]
    try:
        h = model.model(tok).last_hidden_state
    finally:
        for hk in hooks:
            hk.remove()
    states = torch.cat([captured[l] for l in layers], dim=-1)
    E = model.model.embed_tokens.weight
    greedy = torch.cat([(c @ E.T).argmax(-1) for c in h.reshape(-1, h.shape[-1]).split(4096)]).view(tok.shape)
    return tok, valid, states, greedy


def make_blocks(tok, valid, greedy, plens, cfg, anchors, gen, every=False):
    """Anchors per sequence (with `every`: answer positions evenly spaced, at most EVAL_ANCHORS), the blocks'
    tokens and row labels (-100: none)."""
    B, T = tok.shape
    Bk = cfg.block
    lens = valid.sum(1).tolist()
    per_seq = []
    for b in range(B):
        lo, hi = max(int(plens[b]), 1), lens[b] - 1  # the anchor's next position must exist
        cand = np.arange(lo, hi)
        if every and cand.size > EVAL_ANCHORS:
            cand = np.unique(cand[np.linspace(0, cand.size - 1, EVAL_ANCHORS).astype(int)])
        elif not every and cand.size > anchors:
            cand = np.sort(gen.choice(cand, anchors, replace=False))
        per_seq.append(cand)
    M = max(1, max(len(c) for c in per_seq))
    a = torch.zeros(B, M, dtype=torch.long)
    used = torch.zeros(B, M, dtype=torch.bool)
    for b, c in enumerate(per_seq):
        a[b, :len(c)] = torch.from_numpy(c)
        used[b, :len(c)] = True
    a, used = a.to(tok.device), used.to(tok.device)
    blocks = torch.full((B, M, Bk), cfg.mask_token, dtype=torch.long, device=tok.device)
    blocks[:, :, 0] = tok.gather(1, a)
    # Row i predicts the token at a + i: the target's greedy token after position a + i - 1.
    src = a[:, :, None] + torch.arange(Bk - 1, device=tok.device)  # positions a .. a + Bk - 2
    ok = (src < valid.sum(1)[:, None, None] - 1) & used[:, :, None]
    labels = greedy.gather(1, src.clamp(max=T - 1).view(B, -1)).view(B, M, Bk - 1)
    labels = torch.where(ok, labels, torch.full_like(labels, -100))
    return a, blocks, labels


def draft_vocabulary(seqs, n, special):
    """The `special` ids and the most frequent answer tokens of the training conversations, `n` in all, sorted
    (the drafter's output matrix is restricted to them); None for the full vocabulary."""
    if n <= 0:
        return None
    counts = {}
    for i in seqs.train:
        toks, plen = seqs.seqs[i]
        for t in toks[plen:].tolist():
            counts[t] = counts.get(t, 0) + 1
    chosen = list(dict.fromkeys(special))
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= n:
            break
        if t not in chosen:
            chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def to_draft_index(labels, index):
    """Labels as indices into the draft vocabulary (-100 outside it); `index` maps a token id to its index or
    -100."""
    return torch.where(labels >= 0, index[labels.clamp(min=0)], labels)


def block_loss(drafter, E, states, valid, a, blocks, labels, gamma, dv=None, index=None):
    hid = drafter.forward_blocks(states, E, blocks, a, valid)[:, :, 1:]  # [B, M, Bk-1, h]
    head = E if dv is None else E[dv]
    if dv is not None:
        labels = to_draft_index(labels, index)
    logits = hid.reshape(-1, hid.shape[-1]) @ head.T
    ce = F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=-100, reduction="none")
    w = torch.exp(-torch.arange(labels.shape[-1], device=E.device, dtype=torch.float32) / gamma)
    w = w.expand_as(labels).reshape(-1) * (labels.reshape(-1) != -100)
    return (ce * w).sum() / w.sum().clamp_min(1e-9)


@torch.no_grad()
def evaluate(drafter, model, seqs, cfg, device, n_seqs, max_len, dv=None, chunk=4):
    E = model.model.embed_tokens.weight
    head = E if dv is None else E[dv]
    idx = seqs.held[:n_seqs]
    accepted = []
    per_row = np.zeros(cfg.block - 1)
    for s in range(0, len(idx), chunk):
        part = idx[s:s + chunk]
        tok, valid, states, greedy = target_pass(model, part, seqs, cfg.target_layers, device, max_len)
        plens = [seqs.seqs[i][1] for i in part]
        a, blocks, labels = make_blocks(tok, valid, greedy, plens, cfg, 0, None, every=True)
        hid = drafter.forward_blocks(states, E, blocks, a, valid)[:, :, 1:]
        drafts = (hid @ head.T).argmax(-1)
        if dv is not None:
            drafts = dv[drafts]
        hit = (drafts == labels) & (labels != -100)
        lead = hit.long().cumprod(-1)  # rows accepted in a row from the first
        real = labels[:, :, 0] != -100
        accepted.extend(lead.sum(-1)[real].tolist())
        per_row += lead[real].float().sum(0).cpu().numpy()
    n = max(1, len(accepted))
    return {
        "blocks": len(accepted),
        "accepted_per_block": float(np.mean(accepted)) if accepted else 0.0,
        "tokens_per_cycle": 1.0 + (float(np.mean(accepted)) if accepted else 0.0),
        "accepted_by_row": (per_row / n).round(4).tolist(),
    }


def export(drafter, cfg, out_dir, meta, dv=None):
    from safetensors.torch import save_file
    d = os.path.join(out_dir, "drafter")
    os.makedirs(d, exist_ok=True)
    tensors = drafter.state_dict_hf()
    if dv is not None:
        tensors["draft_vocab"] = dv.to(torch.int32).cpu().contiguous()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg.hf_config(), "verity": meta}, f, indent=1)
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--data", required=True, help="one or more .npz files, comma-separated")
    p.add_argument("--out", default="out-dflash")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--target-layers", default="1,8,15,22,28")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--mask-token", type=int, default=0, help="SmolLM2's <|endoftext|>, which chats never hold")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    p.add_argument("--seqs-per-step", type=int, default=32)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--gamma", type=float, default=4.0, help="row weight exp(-(i-1)/gamma)")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (default: from the time budget)")
    p.add_argument("--train-budget-s", type=float, default=420)
    p.add_argument("--eval-seqs", type=int, default=96)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft from this many ids (0: the full vocabulary)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--init-from", help="an exported drafter's model.safetensors to continue from (same layout)")
    p.add_argument("--tf32", type=int, default=1,
                   help="the frozen target's matmuls in TF32 on a GPU (labels: its greedy tokens; a near-tie may "
                        "flip, as it may between any two kernels of the quantized target)")
    args = p.parse_args()

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seed_all(args.seed)
    gcfg = gguf_config(args.gguf)
    tok_, model = load_target(args.gguf, device)
    layers = [int(x) for x in args.target_layers.split(",")]
    assert all(0 <= l < gcfg["n_layers"] for l in layers), layers
    cfg = DrafterConfig(hidden=gcfg["hidden"], layers=args.layers, n_heads=gcfg["n_heads"],
                        n_kv_heads=gcfg["n_kv_heads"], head_dim=gcfg["head_dim"], ffn=gcfg["ffn"], eps=gcfg["eps"],
                        rope_theta=gcfg["rope_theta"], vocab=gcfg["vocab"], target_layers=layers,
                        block=args.block, mask_token=args.mask_token)
    seqs = Sequences(args.data)
    log(f"data: {len(seqs.train)} training and {len(seqs.held)} held-out conversations; device {device}")
    drafter = BlockDrafter(cfg)
    if args.init_from:
        from safetensors.torch import load_file
        drafter.load_state_dict_hf(load_file(args.init_from))
        log(f"continuing from {args.init_from}")
    drafter = drafter.to(device)
    if device == "cuda" and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    E = model.model.embed_tokens.weight
    special = [0, gcfg["bos"], gcfg["eos"], args.mask_token, 1, 2]
    dv = draft_vocabulary(seqs, args.draft_vocab, special)
    index = None
    if dv is not None:
        dv = dv.to(device)
        index = torch.full((gcfg["vocab"],), -100, dtype=torch.long, device=device)
        index[dv] = torch.arange(len(dv), device=device)
        held = np.concatenate([seqs.seqs[i][0][seqs.seqs[i][1]:] for i in seqs.held])
        cover = float((index[torch.from_numpy(held).to(device)] >= 0).float().mean())
        log(f"draft vocabulary: {len(dv)} ids, covering {cover:.4f} of the held-out answer tokens")
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))
    gen = np.random.default_rng(args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    before = evaluate(drafter, model, seqs, cfg, device, min(args.eval_seqs, 16), args.max_len, dv)
    log(f"before training: {before['tokens_per_cycle']:.3f} tokens/cycle")

    t0, step, losses = time.time(), 0, []
    warm_s = None  # seconds the warmup took: with a time budget, the cosine runs over the time after it
    while True:
        if args.steps and step >= args.steps:
            break
        if not args.steps and time.time() - t0 > args.train_budget_s:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup:
            if warm_s is None:
                warm_s = time.time() - t0
            if args.steps:
                frac = (step - args.warmup) / max(1, args.steps - args.warmup)
            else:
                frac = (time.time() - t0 - warm_s) / max(1e-9, args.train_budget_s - warm_s)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = gen.choice(seqs.train, args.seqs_per_step, replace=False).tolist()
        tok, valid, states, greedy = target_pass(model, idx, seqs, layers, device, args.max_len)
        plens = [seqs.seqs[i][1] for i in idx]
        a, blocks, labels = make_blocks(tok, valid, greedy, plens, cfg, args.anchors, gen)
        with amp:
            loss = block_loss(drafter, E, states, valid, a, blocks, labels, args.gamma, dv, index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % args.log_every == 0:
            log(f"step {step} lr {lr:.2e} loss {np.mean(losses[-args.log_every:]):.4f}")

    metrics = evaluate(drafter, model, seqs, cfg, device, args.eval_seqs, args.max_len, dv)
    log(f"held-out: {metrics['tokens_per_cycle']:.3f} tokens/cycle; accepted by row {metrics['accepted_by_row']}")
    meta = {"target_gguf_sha256": sha256_file(args.gguf), "steps": step, "seed": args.seed,
            "final_loss": float(np.mean(losses[-50:])) if losses else None, "heldout": metrics,
            "untrained_tokens_per_cycle": before["tokens_per_cycle"], "args": vars(args)}
    d = export(drafter, cfg, args.out, meta, dv)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(meta, f, indent=1)
    log(f"exported {d}")


if __name__ == "__main__":
    main()
