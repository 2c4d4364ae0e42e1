#!/usr/bin/env python3
"""Random-weight drafting models beside a Llama-shaped GGUF: a bundle folder with an MTP head and/or a block
drafter of the target's shape, for timing drafting at real model sizes (drafting speed depends on the models'
shapes, not their values).

    python tools/bundles/random_drafting.py --shape 1b --target /tmp/big/1b-q4_k_m.gguf --out /tmp/big/1b-mtp
    python tools/bundles/random_drafting.py --shape 1b --target /tmp/big/1b-q4_k_m.gguf --out /tmp/big/1b-drafter \
        --no-head --drafter

writes OUT/ with a hard link to the target GGUF (a copy where linking fails), and:
- `mtp.safetensors` (unless --no-head): one head block of the target's shape (see llama_shaped.py's SHAPES) in
  the verity-mtp/1 layout the trained SmolLM2 head ships (`tools/train/train_mtp.py`): the joint fusion
  `mtp.fc.weight` (d × 2d), the two input norms, one decoder layer and the final norm;
- `drafter/` (with --drafter): a DFlash-style block drafter (`config.json`, `model.safetensors`) of one layer
  of the target's shape with per-head Q/K norms, reading five of the target's layers spread over its depth,
  blocks of --block rows, in the layout `tools/train/dflash_drafter.py` exports.
Both draft from --draft-vocab token ids (0: the whole vocabulary; the output layer is the target's). BF16 weights
N(0, 0.02), seeded; norms 1.

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
    ap.add_argument("--no-head", action="store_true", help="write no MTP head")
    ap.add_argument("--drafter", action="store_true", help="write a block drafter")
    ap.add_argument("--block", type=int, default=8, help="the drafter's block rows (the pending token and k - 1 drafts)")
    a = ap.parse_args()
    _, d, ffn, heads, kv_heads, head_dim = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)

    def w(rows: int, cols: int) -> bytes:
        return bf16(rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32))

    ones = lambda n: bf16(np.ones(n, np.float32))  # noqa: E731
    qd, kvd = heads * head_dim, kv_heads * head_dim

    def layer(p: str, qk_norm: bool) -> list:
        t = [
            (p + "input_layernorm.weight", "BF16", [d], ones(d)),
            (p + "self_attn.q_proj.weight", "BF16", [qd, d], w(qd, d)),
            (p + "self_attn.k_proj.weight", "BF16", [kvd, d], w(kvd, d)),
            (p + "self_attn.v_proj.weight", "BF16", [kvd, d], w(kvd, d)),
            (p + "self_attn.o_proj.weight", "BF16", [d, qd], w(d, qd)),
            (p + "post_attention_layernorm.weight", "BF16", [d], ones(d)),
            (p + "mlp.gate_proj.weight", "BF16", [ffn, d], w(ffn, d)),
            (p + "mlp.up_proj.weight", "BF16", [ffn, d], w(ffn, d)),
            (p + "mlp.down_proj.weight", "BF16", [d, ffn], w(d, ffn)),
        ]
        if qk_norm:
            t += [(p + "self_attn.q_norm.weight", "BF16", [head_dim], ones(head_dim)),
                  (p + "self_attn.k_norm.weight", "BF16", [head_dim], ones(head_dim))]
        return t

    ids = np.sort(rng.choice(a.vocab, a.draft_vocab, replace=False)).astype(np.int32) if a.draft_vocab else None
    a.out.mkdir(parents=True, exist_ok=True)
    link = a.out / a.target.name
    if not link.exists():
        try:
            os.link(a.target, link)
        except OSError:
            shutil.copyfile(a.target, link)
    if not a.no_head:
        tensors = [
            ("mtp.fc.weight", "BF16", [d, 2 * d], w(d, 2 * d)),
            ("mtp.pre_fc_norm_embedding.weight", "BF16", [d], ones(d)),
            ("mtp.pre_fc_norm_hidden.weight", "BF16", [d], ones(d)),
            *layer("mtp.layers.0.", False),
            ("mtp.norm.weight", "BF16", [d], ones(d)),
        ]
        if ids is not None:
            tensors.append(("mtp.draft_vocab", "I32", [len(ids)], ids.tobytes()))
        meta = {"target": a.target.name, "format": "verity-mtp/1", "rope_style": "half_split",
                "num_nextn_predict_layers": "1"}
        write_safetensors(a.out / "mtp.safetensors", tensors, meta)
    if a.drafter:
        layers = SHAPES[a.shape][0]
        target_layers = sorted({round(1 + i * (layers - 3) / 4) for i in range(5)})
        tensors = [
            ("fc.weight", "BF16", [d, len(target_layers) * d], w(d, len(target_layers) * d)),
            ("hidden_norm.weight", "BF16", [d], ones(d)),
            ("norm.weight", "BF16", [d], ones(d)),
            *layer("layers.0.", True),
        ]
        if ids is not None:
            tensors.append(("draft_vocab", "I32", [len(ids)], ids.tobytes()))
        config = {
            "architectures": ["DFlashDraftModel"], "hidden_size": d, "num_hidden_layers": 1,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": ffn, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "dflash_config": {"target_layer_ids": target_layers, "block_size": a.block,
                              "mask_token_id": a.vocab - 1},
        }
        (a.out / "drafter").mkdir(exist_ok=True)
        (a.out / "drafter" / "config.json").write_text(json.dumps(config, indent=1))
        write_safetensors(a.out / "drafter" / "model.safetensors", tensors, {})
    what = [x for x, on in (("head", not a.no_head), ("drafter", a.drafter)) if on]
    print(f"wrote {a.out} ({a.shape}: {' and '.join(what) or 'nothing'}, draft vocabulary {a.draft_vocab or 'all'})")


if __name__ == "__main__":
    main()
