#!/usr/bin/env python3
"""A random-weight MTP head beside a Llama-shaped GGUF: a bundle folder that resolves to the MTP route, for
timing a head's drafting at real model sizes (drafting speed depends on the head's shapes, not its values).

    python tools/bundles/mtp_head.py --shape 1b --target /tmp/big/1b-q4_k_m.gguf --out /tmp/big/1b-mtp

writes OUT/ with a hard link to the target GGUF (a copy where linking fails) and OUT/mtp.safetensors: one
head block of the target's shape (see llama_shaped.py's SHAPES) in the verity-mtp/1 layout the trained
SmolLM2 head ships (`tools/train/train_mtp.py`): the joint fusion `mtp.fc.weight` (d × 2d), the two input
norms, one decoder layer, the final norm and a draft vocabulary of --draft-vocab token ids (0 for the whole
vocabulary; the output layer is the target's tied rows). BF16 weights N(0, 0.02), seeded; norms 1.

Needs numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from llama_shaped import SHAPES


def bf16(a: np.ndarray) -> bytes:
    """Round-to-nearest-even BF16 bytes of a float32 array."""
    u = a.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).tobytes()


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]], meta: dict) -> None:
    header: dict = {"__metadata__": meta}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, _, data in tensors:
            f.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=[s for s in SHAPES if s != "gemma3-270m"])
    ap.add_argument("--target", required=True, type=Path, help="the Llama-shaped GGUF the head drafts for")
    ap.add_argument("--out", required=True, type=Path, help="the bundle folder to write")
    ap.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size (SmolLM2's tokenizer)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="token ids the head drafts from (0: all)")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    _, d, ffn, heads, kv_heads, head_dim = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)

    def w(rows: int, cols: int) -> bytes:
        return bf16(rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32))

    ones = bf16(np.ones(d, np.float32))
    qd, kvd = heads * head_dim, kv_heads * head_dim
    p = "mtp.layers.0."
    tensors = [
        ("mtp.fc.weight", "BF16", [d, 2 * d], w(d, 2 * d)),
        ("mtp.pre_fc_norm_embedding.weight", "BF16", [d], ones),
        ("mtp.pre_fc_norm_hidden.weight", "BF16", [d], ones),
        (p + "input_layernorm.weight", "BF16", [d], ones),
        (p + "self_attn.q_proj.weight", "BF16", [qd, d], w(qd, d)),
        (p + "self_attn.k_proj.weight", "BF16", [kvd, d], w(kvd, d)),
        (p + "self_attn.v_proj.weight", "BF16", [kvd, d], w(kvd, d)),
        (p + "self_attn.o_proj.weight", "BF16", [d, qd], w(d, qd)),
        (p + "post_attention_layernorm.weight", "BF16", [d], ones),
        (p + "mlp.gate_proj.weight", "BF16", [ffn, d], w(ffn, d)),
        (p + "mlp.up_proj.weight", "BF16", [ffn, d], w(ffn, d)),
        (p + "mlp.down_proj.weight", "BF16", [d, ffn], w(d, ffn)),
        ("mtp.norm.weight", "BF16", [d], ones),
    ]
    if a.draft_vocab:
        ids = np.sort(rng.choice(a.vocab, a.draft_vocab, replace=False)).astype(np.int32)
        tensors.append(("mtp.draft_vocab", "I32", [a.draft_vocab], ids.tobytes()))
    a.out.mkdir(parents=True, exist_ok=True)
    link = a.out / a.target.name
    if not link.exists():
        try:
            os.link(a.target, link)
        except OSError:
            shutil.copyfile(a.target, link)
    meta = {"target": a.target.name, "format": "verity-mtp/1", "rope_style": "half_split",
            "num_nextn_predict_layers": "1"}
    write_safetensors(a.out / "mtp.safetensors", tensors, meta)
    print(f"wrote {a.out} ({a.shape} head, draft vocabulary {a.draft_vocab or 'all'})")


if __name__ == "__main__":
    main()
