"""Train a native multi-token-prediction (MTP) head for SmolLM2-135M-Instruct (GGUF Q4_1) by
self-distillation, evaluate it under the inference procedure, and export it (verity-mtp/1).

Subcommands:
  all    generate data with the target, train, evaluate, export (the device run)
  check  only the target checks (hidden @ lm_head == logits; our Llama block == the target's layer)

See tools/train/README.md for the commands and assets/mtp/smollm2-135m/README.md for the results.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtp_head import HeadConfig, MTPHead, reference_chain_outputs  # noqa: E402
from prompts import build_conversations, is_heldout  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# Target
# ------------------------------------------------------------------------------------------------

def gguf_config(path):
    from gguf import GGUFReader
    r = GGUFReader(path)

    def val(k):
        return r.fields[k].contents()
    arch = val("general.architecture")
    assert arch == "llama", arch
    cfg = dict(
        hidden=int(val("llama.embedding_length")), n_layers=int(val("llama.block_count")),
        n_heads=int(val("llama.attention.head_count")), n_kv_heads=int(val("llama.attention.head_count_kv")),
        ffn=int(val("llama.feed_forward_length")), eps=float(val("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(val("llama.rope.freq_base")), vocab=int(val("llama.vocab_size")),
        rope_dim=int(val("llama.rope.dimension_count")), eos=int(val("tokenizer.ggml.eos_token_id")),
        bos=int(val("tokenizer.ggml.bos_token_id")),
    )
    cfg["head_dim"] = cfg["hidden"] // cfg["n_heads"]
    assert cfg["rope_dim"] == cfg["head_dim"]
    return cfg


def load_target(gguf_path, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


@torch.no_grad()
def target_checks(model, tok, gcfg, device):
    """Assert: post-final-norm hidden @ lm_head == logits, tied embeddings, and that our LlamaBlock with the
    target's last layer's weights reproduces that layer (so the head's block matches the target's)."""
    c = model.config
    assert c.hidden_size == gcfg["hidden"] and c.num_attention_heads == gcfg["n_heads"]
    assert c.num_key_value_heads == gcfg["n_kv_heads"] and c.intermediate_size == gcfg["ffn"]
    assert c.vocab_size == gcfg["vocab"] and c.num_hidden_layers == gcfg["n_layers"]
    assert abs(c.rms_norm_eps - gcfg["eps"]) < 1e-12, (c.rms_norm_eps, gcfg["eps"])
    theta = c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta
    assert float(theta) == gcfg["rope_theta"], (theta, gcfg["rope_theta"])
    E = model.model.embed_tokens.weight
    assert torch.equal(E, model.lm_head.weight), "embeddings are not tied"
    msgs = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids], device=device)
    out = model(ids, output_hidden_states=True)
    h = model.model(ids).last_hidden_state
    logits2 = h @ E.T
    err = (out.logits - logits2).abs().max().item()
    log(f"check: max|logits - last_hidden_state @ E^T| = {err:.2e}")
    assert err < 1e-3, err
    hs = out.hidden_states
    assert torch.allclose(hs[-1], h, atol=1e-5), "hidden_states[-1] is not the post-norm hidden"
    # our block with the last target layer's weights
    hc = HeadConfig(hidden=gcfg["hidden"], n_heads=gcfg["n_heads"], n_kv_heads=gcfg["n_kv_heads"],
                    head_dim=gcfg["head_dim"], ffn=gcfg["ffn"], eps=gcfg["eps"], rope_theta=gcfg["rope_theta"])
    from mtp_head import LlamaBlock
    blk = LlamaBlock(hc).to(device)
    last = model.model.layers[-1]
    copy_layer_into_block(last, blk)
    x_in = hs[-2]  # input to the last layer
    y = blk.forward_causal(x_in)
    y_normed = model.model.norm(y)
    err2 = (y_normed - h).abs().max().item()
    log(f"check: our LlamaBlock(last layer weights) then final norm vs target post-norm hidden: max|diff| = {err2:.2e}")
    assert err2 < 1e-3, err2
    return hc


def copy_layer_into_block(layer, blk):
    with torch.no_grad():
        blk.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        blk.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(blk, n).weight.copy_(getattr(layer.self_attn, n).weight)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(blk, n).weight.copy_(getattr(layer.mlp, n).weight)


# ------------------------------------------------------------------------------------------------
# Data generation
# ------------------------------------------------------------------------------------------------

def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


@torch.no_grad()
def generate_batch(model, prompts, eos, max_new, device, sample_temp=None):
    """prompts: list of token-id lists. Left padding. Returns the answers (cut after the first EOS, EOS kept)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), eos, dtype=torch.long)
    att = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    kw = dict(do_sample=False) if sample_temp is None else dict(do_sample=True, temperature=sample_temp, top_k=0, top_p=1.0)
    out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new,
                         pad_token_id=eos, eos_token_id=eos, **kw)
    new = out[:, L:].tolist()
    answers = []
    for row in new:
        if eos in row:
            row = row[: row.index(eos) + 1]
        answers.append(row)
    return answers


def generate_data(model, tok, convs, args, gcfg, device):
    eos = gcfg["eos"]
    gen_t0 = time.time()
    held = [c for c in convs if is_heldout(c)]
    train = [c for c in convs if not is_heldout(c)]
    seqs = []  # dicts: prompt, answer, conv, heldout, sampled
    first_answer = {}  # single-turn text -> greedy answer token ids
    order = [c for c in held if len(c["turns"]) == 1] + [c for c in train if len(c["turns"]) == 1]
    B = args.gen_batch
    n_batches = 0

    def over(frac):
        return time.time() - gen_t0 > args.gen_budget_s * frac

    # round 1: single-turn, greedy
    for s in range(0, len(order), B):
        if over(0.75):
            log(f"gen: round 1 stopped by budget after {s} prompts")
            break
        chunk = order[s:s + B]
        prompts = [chat_ids(tok, [{"role": "user", "content": c["turns"][0]}]) for c in chunk]
        t = time.time()
        answers = generate_batch(model, prompts, eos, args.max_new_tokens, device)
        n_batches += 1
        for c, p, a in zip(chunk, prompts, answers):
            seqs.append(dict(prompt=p, answer=a, conv=c["id"], kind=c["kind"], heldout=is_heldout(c), sampled=False))
            first_answer[c["turns"][0]] = a
        log(f"gen r1 batch {n_batches}: {len(chunk)} prompts, max prompt {max(map(len, prompts))}, "
            f"mean answer {np.mean([len(a) for a in answers]):.0f} tok, {time.time() - t:.1f}s")
    # round 2: multi-turn follow-ups after the target's own greedy first answer
    multi = [c for c in held if len(c["turns"]) == 2] + [c for c in train if len(c["turns"]) == 2]
    multi = [c for c in multi if c["turns"][0] in first_answer]
    for s in range(0, len(multi), B):
        if over(0.9):
            log("gen: round 2 stopped by budget")
            break
        chunk = multi[s:s + B]
        prompts = []
        for c in chunk:
            a0 = first_answer[c["turns"][0]]
            a0_text = tok.decode([t for t in a0 if t != eos], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
            prompts.append(chat_ids(tok, [{"role": "user", "content": c["turns"][0]},
                                          {"role": "assistant", "content": a0_text},
                                          {"role": "user", "content": c["turns"][1]}]))
        t = time.time()
        answers = generate_batch(model, prompts, eos, args.max_new_tokens, device)
        n_batches += 1
        for c, p, a in zip(chunk, prompts, answers):
            seqs.append(dict(prompt=p, answer=a, conv=c["id"], kind=c["kind"], heldout=is_heldout(c), sampled=False))
        log(f"gen r2 batch: {len(chunk)} prompts, max prompt {max(map(len, prompts))}, {time.time() - t:.1f}s")
    # round 3: temperature-0.7 samples of training single-turn prompts, while budget remains
    g = torch.Generator().manual_seed(args.seed + 7)
    pool = [c for c in train if len(c["turns"]) == 1]
    perm = torch.randperm(len(pool), generator=g).tolist()
    pool = [pool[i] for i in perm]
    torch.manual_seed(args.seed + 11)
    n_sampled = 0
    for s in range(0, min(len(pool), args.max_sampled), B):
        if over(1.0 - args.gen_last_batch_frac):
            break
        chunk = pool[s:s + B]
        prompts = [chat_ids(tok, [{"role": "user", "content": c["turns"][0]}]) for c in chunk]
        t = time.time()
        answers = generate_batch(model, prompts, eos, args.max_new_tokens, device, sample_temp=0.7)
        n_batches += 1
        n_sampled += len(chunk)
        for c, p, a in zip(chunk, prompts, answers):
            seqs.append(dict(prompt=p, answer=a, conv=c["id"], kind=c["kind"], heldout=False, sampled=True))
        log(f"gen r3 (T=0.7) batch: {len(chunk)} prompts, {time.time() - t:.1f}s")
    log(f"gen: {len(seqs)} sequences ({n_sampled} sampled) in {n_batches} batches, {time.time() - gen_t0:.1f}s")
    return seqs


# ------------------------------------------------------------------------------------------------
# Target hidden states (precomputed, flat storage)
# ------------------------------------------------------------------------------------------------

class Flat:
    """All sequences concatenated: tokens, target hidden h (post-norm, fp32), greedy labels g = argmax(E h)."""

    def __init__(self, seqs, model, device, batch_tokens=65536):
        E = model.model.embed_tokens.weight
        self.lens = torch.tensor([len(s["prompt"]) + len(s["answer"]) for s in seqs])
        self.plens = torch.tensor([len(s["prompt"]) for s in seqs])
        self.offs = torch.zeros(len(seqs), dtype=torch.long)
        self.offs[1:] = torch.cumsum(self.lens, 0)[:-1]
        N = int(self.lens.sum())
        H = E.shape[1]
        self.tok = torch.empty(N, dtype=torch.long, device=device)
        self.h = torch.empty(N, H, dtype=torch.float32, device=device)
        self.g = torch.empty(N, dtype=torch.long, device=device)
        order = sorted(range(len(seqs)), key=lambda i: int(self.lens[i]))
        groups, cur = [], []
        for i in order:  # ascending length: the last member is the longest
            if cur and (len(cur) + 1) * int(self.lens[i]) > batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
        with torch.no_grad():
            for idx in groups:
                Tm = max(int(self.lens[j]) for j in idx)
                ids = torch.full((len(idx), Tm), 2, dtype=torch.long)
                for r, j in enumerate(idx):
                    s = seqs[j]
                    ids[r, : self.lens[j]] = torch.tensor(s["prompt"] + s["answer"])
                ids = ids.to(device)
                hb = model.model(ids).last_hidden_state  # right padding: causal, pads only at the end
                gb = torch.cat([(c @ E.T).argmax(-1) for c in hb.reshape(-1, hb.shape[-1]).split(8192)]).view(hb.shape[:2])
                for r, j in enumerate(idx):
                    o, L = int(self.offs[j]), int(self.lens[j])
                    self.tok[o:o + L] = ids[r, :L]
                    self.h[o:o + L] = hb[r, :L]
                    self.g[o:o + L] = gb[r, :L]
        self.lens_d, self.plens_d, self.offs_d = self.lens.to(device), self.plens.to(device), self.offs.to(device)

    def batch(self, idx, device):
        idx_t = torch.as_tensor(idx, device=device)
        lens, plens, offs = self.lens_d[idx_t], self.plens_d[idx_t], self.offs_d[idx_t]
        Tm = int(lens.max())
        ar = torch.arange(Tm, device=device)
        valid = ar[None, :] < lens[:, None]
        gi = offs[:, None] + torch.minimum(ar[None, :], lens[:, None] - 1)
        return dict(tok=self.tok[gi], h=self.h[gi], g=self.g[gi], valid=valid, lens=lens, plens=plens,
                    ans=(ar[None, :] >= plens[:, None]) & valid)


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------

def rows_loss(out_rows, h_rows, labels, weights, E_bf16, kl_weight):
    """CE against the target's greedy token + KL(target || head) over the full vocabulary; weighted mean."""
    logits = (out_rows.to(torch.bfloat16) @ E_bf16.T).float()
    logp = F.log_softmax(logits, -1)
    ce = -logp.gather(1, labels[:, None])[:, 0]
    loss = ce
    kl = torch.zeros_like(ce)
    if kl_weight > 0:
        with torch.no_grad():
            tlogp = F.log_softmax((h_rows.to(torch.bfloat16) @ E_bf16.T).float(), -1)
        kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
        loss = ce + kl_weight * kl
    wsum = weights.sum().clamp_min(1e-6)
    return (loss * weights).sum() / wsum, (ce * weights).sum().detach() / wsum, (kl * weights).sum().detach() / wsum


def depth_rows(b, d):
    """Rows (b, j) where depth d is trained: the chain start j-d+1 >= 0 and the next token j+1 exists."""
    B, T = b["tok"].shape
    j = torch.arange(T, device=b["tok"].device)[None, :]
    has_next = (j + 1) < b["lens"][:, None]
    return has_next & (j >= d - 1)


def compute_loss(head, E, E_bf16, b, depth, depth_w, prompt_w, kl_weight, use_ckpt=True):
    outs = head.forward_unrolled(E, b["h"], b["tok"], depth)
    total = 0.0
    stats = []
    T = b["tok"].shape[1]
    j = torch.arange(T, device=b["tok"].device)[None, :]
    ans_next = (j + 1) >= b["plens"][:, None]  # the predicted token t_{j+1} is an answer token
    for d in range(1, depth + 1):
        m = depth_rows(b, d)
        w = torch.where(ans_next, 1.0, prompt_w)[m]
        args = (outs[d - 1][m], b["h"][m], b["g"][m], w, E_bf16, kl_weight)
        if use_ckpt:
            l, ce, kl = torch.utils.checkpoint.checkpoint(rows_loss, *args, use_reentrant=False)
        else:
            l, ce, kl = rows_loss(*args)
        total = total + depth_w[d - 1] * l
        stats.append(torch.stack([ce, kl]))
    return total, torch.stack(stats)  # [D, 2] (ce, kl), tensors (no host sync)


# ------------------------------------------------------------------------------------------------
# Evaluation under the inference procedure
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(head, E, flat, seq_idx, depth, device, bs=32, kl_weight=1.0):
    """Per-depth CE/KL (answer positions), chain-conditional top-1 accuracy, and simulated greedy
    speculative decoding (accepted drafts per target forward) for draft depth D = 1..depth."""
    E_bf16 = E.to(torch.bfloat16)
    ce_sum = torch.zeros(depth, dtype=torch.float64)
    kl_sum = torch.zeros(depth, dtype=torch.float64)
    cnt = torch.zeros(depth, dtype=torch.float64)
    cond_num = torch.zeros(depth, dtype=torch.float64)  # chains with depths 1..d all correct
    cond_den = torch.zeros(depth, dtype=torch.float64)  # chains with depths 1..d-1 all correct
    uncond = torch.zeros(depth, dtype=torch.float64)
    uncond_n = torch.zeros(depth, dtype=torch.float64)
    sim_tokens = torch.zeros(depth, dtype=torch.float64)
    sim_steps = torch.zeros(depth, dtype=torch.float64)
    sim_acc = torch.zeros(depth, dtype=torch.float64)
    greedy_match, greedy_n = 0, 0
    for s in range(0, len(seq_idx), bs):
        b = flat.batch(seq_idx[s:s + bs], device)
        outs = head.forward_unrolled(E, b["h"], b["tok"], depth)
        B, T = b["tok"].shape
        nxt = torch.cat([b["tok"][:, 1:], b["tok"][:, -1:]], 1)  # data token t_{j+1}
        j = torch.arange(T, device=device)[None, :]
        ans_next = ((j + 1) >= b["plens"][:, None]) & ((j + 1) < b["lens"][:, None])
        greedy_match += int(((b["g"] == nxt) & ans_next).sum())
        greedy_n += int(ans_next.sum())
        correct = []
        for d in range(1, depth + 1):
            o = outs[d - 1]
            logits = (o @ E.T).float()
            pred = logits.argmax(-1)
            correct.append(pred == nxt)
            m = ans_next & (j >= d - 1)
            if m.any():
                l, ce, kl = rows_loss(o[m], b["h"][m], b["g"][m], torch.ones(int(m.sum()), device=device), E_bf16, kl_weight)
                n = int(m.sum())
                ce_sum[d - 1] += float(ce) * n
                kl_sum[d - 1] += float(kl) * n
                cnt[d - 1] += n
                uncond[d - 1] += float((pred == nxt)[m].sum())
                uncond_n[d - 1] += n
        # chains: start p with p >= P (first answer token committed by the target), depth d predicts t_{p+d}
        C = torch.stack(correct, 0).cpu().numpy()  # [D,B,T]; C[d-1,b,j] = depth-d prediction at j correct
        for r in range(B):
            L, P = int(b["lens"][r]), int(b["plens"][r])
            for p in range(P, L - 1):
                allc = True
                for d in range(1, depth + 1):
                    if p + d > L - 1:
                        break
                    cond_den[d - 1] += 1 if allc else 0
                    allc = allc and bool(C[d - 1, r, p + d - 1])
                    cond_num[d - 1] += 1 if allc else 0
            for D in range(1, depth + 1):
                p = P
                while p < L - 1:
                    a = 0
                    while a < D and p + a + 1 <= L - 1 and bool(C[a, r, p + a]):
                        a += 1
                    step = min(a + 1, L - 1 - p)
                    sim_tokens[D - 1] += step
                    sim_steps[D - 1] += 1
                    sim_acc[D - 1] += a
                    p += a + 1
    res = dict(
        ce=(ce_sum / cnt.clamp_min(1)).tolist(), kl=(kl_sum / cnt.clamp_min(1)).tolist(),
        acc_cond=(cond_num / cond_den.clamp_min(1)).tolist(), acc_teacher_forced=(uncond / uncond_n.clamp_min(1)).tolist(),
        chain_counts=cond_den.tolist(),
        tokens_per_target_forward=(sim_tokens / sim_steps.clamp_min(1)).tolist(),
        accepted_drafts_per_step=(sim_acc / sim_steps.clamp_min(1)).tolist(),
        data_equals_target_greedy=greedy_match / max(1, greedy_n), answer_positions=greedy_n,
    )
    # expected accepted drafts with D drafts, averaged over every chain start (not only verify points)
    acc_all = []
    prod, e = 1.0, 0.0
    for d in range(depth):
        prod *= res["acc_cond"][d]
        e += prod
        acc_all.append(1.0 + e)
    res["tokens_per_forward_iid_estimate"] = acc_all
    return res


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------

CONTRACT = [
    ("mtp.pre_fc_norm_embedding.weight", "pre_fc_norm_embedding.weight", ("H",)),
    ("mtp.pre_fc_norm_hidden.weight", "pre_fc_norm_hidden.weight", ("H",)),
    ("mtp.fc.weight", "fc.weight", ("H", "2H")),
    ("mtp.layers.0.input_layernorm.weight", "block.input_layernorm.weight", ("H",)),
    ("mtp.layers.0.self_attn.q_proj.weight", "block.q_proj.weight", ("H", "H")),
    ("mtp.layers.0.self_attn.k_proj.weight", "block.k_proj.weight", ("KV", "H")),
    ("mtp.layers.0.self_attn.v_proj.weight", "block.v_proj.weight", ("KV", "H")),
    ("mtp.layers.0.self_attn.o_proj.weight", "block.o_proj.weight", ("H", "H")),
    ("mtp.layers.0.post_attention_layernorm.weight", "block.post_attention_layernorm.weight", ("H",)),
    ("mtp.layers.0.mlp.gate_proj.weight", "block.gate_proj.weight", ("F", "H")),
    ("mtp.layers.0.mlp.up_proj.weight", "block.up_proj.weight", ("F", "H")),
    ("mtp.layers.0.mlp.down_proj.weight", "block.down_proj.weight", ("H", "F")),
    ("mtp.norm.weight", "norm.weight", ("H",)),
]


def export(head, draft_vocab, path, gguf_name, gguf_sha, hc):
    from safetensors.torch import load_file, save_file
    dims = {"H": hc.hidden, "2H": 2 * hc.hidden, "KV": hc.n_kv_heads * hc.head_dim, "F": hc.ffn}
    sd = head.state_dict()
    tensors = {}
    for name, key, shape in CONTRACT:
        t = sd[key].detach().float().cpu()
        assert tuple(t.shape) == tuple(dims[s] for s in shape), (name, t.shape)
        tensors[name] = t.to(torch.bfloat16).contiguous()
    assert draft_vocab.dtype == torch.int32 and draft_vocab.numel() == 8192
    tensors["mtp.draft_vocab"] = draft_vocab.cpu().contiguous()
    meta = {"num_nextn_predict_layers": "1", "rope_style": "half_split", "target": gguf_name,
            "target_sha256": gguf_sha, "format": "verity-mtp/1"}
    save_file(tensors, path, metadata=meta)
    back = load_file(path)
    assert set(back) == set(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]), k
    log(f"export: wrote {path} ({os.path.getsize(path)} bytes), {len(tensors)} tensors, metadata {meta}")


def head_rounded_bf16(head):
    h2 = copy.deepcopy(head)
    with torch.no_grad():
        for p in h2.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return h2


# ------------------------------------------------------------------------------------------------
# Main pipeline
# ------------------------------------------------------------------------------------------------

def cmd_all(args):
    seed_all(args.seed)
    torch.use_deterministic_algorithms(False)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)
    deadline = T0 + args.deadline_s
    log(f"device {device}; torch {torch.__version__}; args {vars(args)}")
    if device.type == "cuda":
        log(f"gpu: {torch.cuda.get_device_name(0)}")
    gguf_sha = sha256_file(args.gguf)
    gcfg = gguf_config(args.gguf)
    log(f"gguf {os.path.basename(args.gguf)} sha256 {gguf_sha}; config {gcfg}")
    tok, model = load_target(args.gguf, device)
    log("target loaded")
    hc = target_checks(model, tok, gcfg, device)
    E = model.model.embed_tokens.weight.detach()  # [V,H] fp32 (dequantized Q8_0)

    convs = build_conversations(seed=args.seed)
    if args.max_prompts:
        held = [c for c in convs if is_heldout(c)][: max(2, args.max_prompts // 10)]
        rest = [c for c in convs if not is_heldout(c)]
        singles = [c for c in rest if len(c["turns"]) == 1][: args.max_prompts]
        texts = {c["turns"][0] for c in singles + held}
        multis = [c for c in rest if len(c["turns"]) == 2 and c["turns"][0] in texts][: max(1, args.max_prompts // 10)]
        convs = held + singles + multis
    log(f"prompts: {len(convs)} conversations, {sum(is_heldout(c) for c in convs)} held out")

    if args.data:  # reuse sequences generated by an earlier run (its data.npz)
        with np.load(args.data) as z:  # read each array once (NpzFile decompresses on every access)
            d = {k: z[k] for k in z.files}
        tokens_all = d["tokens"]
        seqs, o = [], 0
        for L, P, ho, sa, cv, kd in zip(d["lens"], d["prompt_lens"], d["heldout"], d["sampled"], d["conv"], d["kind"]):
            t = tokens_all[o:o + L].tolist()
            o += int(L)
            seqs.append(dict(prompt=t[:P], answer=t[P:], conv=str(cv), kind=str(kd), heldout=bool(ho), sampled=bool(sa)))
        log(f"data: {len(seqs)} sequences loaded from {args.data}")
    else:
        seqs = generate_data(model, tok, convs, args, gcfg, device)
    # save generated data
    np.savez_compressed(os.path.join(args.out, "data.npz"),
                        tokens=np.array([t for s in seqs for t in s["prompt"] + s["answer"]], dtype=np.int32),
                        lens=np.array([len(s["prompt"]) + len(s["answer"]) for s in seqs], dtype=np.int32),
                        prompt_lens=np.array([len(s["prompt"]) for s in seqs], dtype=np.int32),
                        heldout=np.array([s["heldout"] for s in seqs]), sampled=np.array([s["sampled"] for s in seqs]),
                        conv=np.array([s["conv"] for s in seqs]), kind=np.array([s["kind"] for s in seqs]))
    ex = [s for s in seqs if s["heldout"]][:2] + [s for s in seqs if not s["heldout"]][:2]
    for s in ex:
        log("example:", repr(tok.decode(s["prompt"] + s["answer"])[-600:]))

    t = time.time()
    flat = Flat(seqs, model, device)
    log(f"target hidden precomputed: {int(flat.lens.sum())} tokens in {time.time() - t:.1f}s")
    train_idx = [i for i, s in enumerate(seqs) if not s["heldout"]]
    held_idx = [i for i, s in enumerate(seqs) if s["heldout"]]
    n_ans_train = sum(len(seqs[i]["answer"]) for i in train_idx)
    n_ans_held = sum(len(seqs[i]["answer"]) for i in held_idx)
    log(f"sequences: train {len(train_idx)} ({int(flat.lens[train_idx].sum())} tok, {n_ans_train} answer tok), "
        f"held-out {len(held_idx)} ({int(flat.lens[held_idx].sum())} tok, {n_ans_held} answer tok)")

    # draft vocabulary
    counts = torch.zeros(gcfg["vocab"], dtype=torch.long)
    for i in train_idx:
        counts += torch.bincount(torch.tensor(seqs[i]["answer"]), minlength=gcfg["vocab"])
    template_ids = set(chat_ids(tok, [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]))
    special = sorted({0, gcfg["bos"], gcfg["eos"]} | template_ids)
    rank = torch.argsort(counts, descending=True, stable=True).tolist()
    chosen = list(special)
    cs = set(chosen)
    for r in rank:
        if len(chosen) >= 8192:
            break
        if r not in cs:
            chosen.append(r)
            cs.add(r)
    draft_vocab = torch.tensor(sorted(chosen), dtype=torch.int32)
    in_dv = torch.zeros(gcfg["vocab"], dtype=torch.bool)
    in_dv[draft_vocab.long()] = True
    held_ans = torch.tensor([t for i in held_idx for t in seqs[i]["answer"]], dtype=torch.long)
    train_ans = torch.tensor([t for i in train_idx for t in seqs[i]["answer"]], dtype=torch.long)
    cov_held = float(in_dv[held_ans].float().mean()) if len(held_ans) else float("nan")
    cov_train = float(in_dv[train_ans].float().mean()) if len(train_ans) else float("nan")
    log(f"draft vocab: {len(draft_vocab)} ids ({int((counts > 0).sum())} distinct answer ids in train); special {special}; "
        f"coverage train answers {cov_train:.4f}, held-out answers {cov_held:.4f}")

    # head
    seed_all(args.seed)
    head = MTPHead(hc).to(device)
    with torch.no_grad():
        # final norm from the target's final norm (contract); the rest PyTorch default init (seeded), or with
        # --init lastlayer the block copied from the target's last layer and fc = 0.5 [I | I] + noise.
        # (At init on CPU smoke data the mean CE was ~19 for default init vs ~40 for lastlayer.)
        head.norm.weight.copy_(model.model.norm.weight)
        if args.init == "lastlayer":
            copy_layer_into_block(model.model.layers[-1], head.block)
            H = hc.hidden
            w = torch.randn(H, 2 * H, device=device) * 0.01
            w[:, :H] += torch.eye(H, device=device) * 0.5
            w[:, H:] += torch.eye(H, device=device) * 0.5
            head.fc.weight.copy_(w)
    if args.init_from:  # comma-separated state_dict files (e.g. the two checkpoint parts)
        sd = {}
        for f in args.init_from.split(","):
            if f.endswith(".safetensors"):  # an exported head (bf16): map the contract names back
                from safetensors.torch import load_file
                st = load_file(f)
                sd.update({key: st[name].float().to(device) for name, key, _ in CONTRACT})
            else:
                sd.update(torch.load(f, map_location=device))
        head.load_state_dict(sd)
    n_params = sum(p.numel() for p in head.parameters())
    log(f"head: {n_params} trainable parameters")
    decay = [p for n, p in head.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in head.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    E_bf16 = E.to(torch.bfloat16)
    depth_w = [max(0.2, 1.0 - 0.2 * d) for d in range(args.depth)]  # 1, .8, .6, .4
    mean_len = float(flat.lens[train_idx].float().mean())
    bsz = max(1, int(args.tokens_per_step / mean_len))
    log(f"train: depth {args.depth} weights {depth_w}; mean seq len {mean_len:.0f}; ~{bsz} sequences/step (<= {args.tokens_per_step} padded tokens)")
    g = torch.Generator().manual_seed(args.seed)

    def batches():
        # each epoch: shuffle, sort chunks of ~32 batches by length, cut batches of <= tokens_per_step padded
        # tokens (count x longest), shuffle the batches; all from a seeded generator
        while True:
            perm = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
            chunk = bsz * 32
            bl = []
            for s in range(0, len(perm), chunk):
                c = sorted(perm[s:s + chunk], key=lambda i: int(flat.lens[i]))
                cur = []
                for i in c:
                    if cur and (len(cur) + 1) * int(flat.lens[i]) > args.tokens_per_step:
                        bl.append(cur)
                        cur = []
                    cur.append(i)
                if cur:
                    bl.append(cur)
            for k in torch.randperm(len(bl), generator=g).tolist():
                yield bl[k]

    it = batches()
    total_steps = args.steps if args.steps else None
    train_t0 = time.time()
    budget_end = min(train_t0 + args.train_budget_s, deadline - args.reserve_s)
    step = 0
    acc_stats, acc_n, last_stats = None, 0, None
    hist = []
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    while True:
        if total_steps is not None and step >= total_steps:
            break
        if total_steps is None and step == args.calib_skip:
            calib_t0 = time.time()  # the first steps (allocator, kernel selection) are slower: not timed
        if total_steps is None and step == args.calib_steps:
            per = (time.time() - calib_t0) / (args.calib_steps - args.calib_skip)
            total_steps = max(step + 1, step + int(0.97 * (budget_end - time.time()) / per))
            total_steps = min(total_steps, args.max_steps)
            log(f"train: {per * 1000:.0f} ms/step -> total steps {total_steps}")
        if time.time() > budget_end:
            log(f"train: wall-clock budget reached at step {step}")
            break
        ts = total_steps or args.max_steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, ts)))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        b = flat.batch(next(it), device)
        with autocast:
            loss, stats = compute_loss(head, E, E_bf16, b, args.depth, depth_w, args.prompt_weight, args.kl_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        acc_stats = stats.detach() if acc_stats is None else acc_stats + stats.detach()
        acc_n += 1
        if step % args.log_every == 0 or step == 1:
            m = (acc_stats / acc_n).tolist()
            acc_stats, acc_n = None, 0
            last_stats = dict(step=step, loss=loss.item(), ce=[round(x[0], 4) for x in m], kl=[round(x[1], 4) for x in m])
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0
            log(f"step {step}/{total_steps} lr {lr:.2e} loss {loss.item():.3f} ce(mean since last log) {last_stats['ce']} "
                f"kl {last_stats['kl']} gnorm {float(gn):.2f} mem {mem:.1f}GiB")
            hist.append(last_stats)
    train_s = time.time() - train_t0
    log(f"train: {step} steps in {train_s:.1f}s")
    ck = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    keys = sorted(ck)
    half = len(keys) // 2
    torch.save({k: ck[k] for k in keys[:half]}, os.path.join(args.out, "ckpt_fp32_part0.pt"))
    torch.save({k: ck[k] for k in keys[half:]}, os.path.join(args.out, "ckpt_fp32_part1.pt"))

    export(head, draft_vocab, os.path.join(args.out, "mtp.safetensors"), os.path.basename(args.gguf), gguf_sha, hc)

    # evaluation with the exported (bf16-rounded) weights, fp32 compute
    evh = head_rounded_bf16(head).eval()
    res_held = evaluate(evh, E, flat, held_idx, args.depth, device)
    log("held-out:", json.dumps(res_held))
    rng = random.Random(args.seed)
    tr_sub = sorted(rng.sample(train_idx, min(len(train_idx), max(len(held_idx), 64))))
    res_train = evaluate(evh, E, flat, tr_sub, args.depth, device)
    log("train subset:", json.dumps(res_train))

    # cross-check on the real weights: unrolled forward == explicit KV-cache loop (one held-out sequence, cropped)
    with torch.no_grad():
        i0 = held_idx[0] if held_idx else train_idx[0]
        b = flat.batch([i0], device)
        Tc = min(int(b["lens"][0]), args.xcheck_len)
        outs = evh.forward_unrolled(E, b["h"][:, :Tc], b["tok"][:, :Tc], args.depth)
        ref = reference_chain_outputs(evh, E, b["h"][0, :Tc], b["tok"][0, :Tc], args.depth)
        xerr = max((outs[d - 1][0, j] - o).abs().max().item() for (d, j), o in ref.items())
        agree = sum(int((outs[d - 1][0, j] @ E.T).argmax() == (o @ E.T).argmax()) for (d, j), o in ref.items())
        log(f"cross-check real weights: unrolled vs step-by-step max|diff| {xerr:.2e}, argmax agree {agree}/{len(ref)}")

    metrics = dict(
        args=vars(args), gguf_sha256=gguf_sha, target_config=gcfg, n_params=n_params,
        n_conversations=len(convs), n_sequences=len(seqs), n_sampled=sum(s["sampled"] for s in seqs),
        train_sequences=len(train_idx), heldout_sequences=len(held_idx),
        train_tokens=int(flat.lens[train_idx].sum()), train_answer_tokens=n_ans_train,
        heldout_tokens=int(flat.lens[held_idx].sum()) if held_idx else 0, heldout_answer_tokens=n_ans_held,
        draft_vocab_coverage_train=cov_train, draft_vocab_coverage_heldout=cov_held,
        steps=step, batch_sequences=bsz, train_seconds=train_s, depth_weights=depth_w,
        final_train_log=last_stats, history=hist, heldout=res_held, train_subset=res_train,
        xcheck_max_diff=xerr, xcheck_argmax_agree=[agree, len(ref)], total_seconds=time.time() - T0,
        gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
    )
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    log("done")


def cmd_check(args):
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    gcfg = gguf_config(args.gguf)
    log(f"config {gcfg}")
    tok, model = load_target(args.gguf, device)
    target_checks(model, tok, gcfg, device)
    log("checks passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("all", "check"):
        p = sub.add_parser(name)
        p.add_argument("--gguf", required=True)
        p.add_argument("--device", default="auto")
        p.add_argument("--out", default="out")
        p.add_argument("--seed", type=int, default=1234)
        p.add_argument("--depth", type=int, default=4)
        p.add_argument("--max-prompts", type=int, default=0, help="limit prompts (local smoke runs)")
        p.add_argument("--max-new-tokens", type=int, default=256)
        p.add_argument("--gen-batch", type=int, default=768)
        p.add_argument("--gen-budget-s", type=float, default=200)
        p.add_argument("--gen-last-batch-frac", type=float, default=0.12, help="no new sampled batch after this fraction of the budget is left")
        p.add_argument("--max-sampled", type=int, default=6000)
        p.add_argument("--tokens-per-step", type=int, default=12288)
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--wd", type=float, default=0.01)
        p.add_argument("--warmup", type=int, default=50)
        p.add_argument("--steps", type=int, default=0, help="fixed step count (default: from the time budget)")
        p.add_argument("--max-steps", type=int, default=20000)
        p.add_argument("--calib-steps", type=int, default=25)
        p.add_argument("--calib-skip", type=int, default=5)
        p.add_argument("--data", default="", help="data.npz of an earlier run: skip generation")
        p.add_argument("--train-budget-s", type=float, default=400)
        p.add_argument("--deadline-s", type=float, default=545, help="whole-run wall clock; training stops reserve-s before it")
        p.add_argument("--reserve-s", type=float, default=50)
        p.add_argument("--prompt-weight", type=float, default=0.1)
        p.add_argument("--kl-weight", type=float, default=1.0)
        p.add_argument("--log-every", type=int, default=100)
        p.add_argument("--xcheck-len", type=int, default=48)
        p.add_argument("--init-from", default="", help="start from a state_dict (.pt) of the head")
        p.add_argument("--init", choices=["random", "lastlayer"], default="random")
    args = ap.parse_args()
    {"all": cmd_all, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    main()
