#!/usr/bin/env python3
"""A Qwen2.5-VL image-text folder with random weights and a real vision transformer's shapes, to time image turns.

The vision side is Qwen2.5-VL's (32 layers, hidden 1280, MLP 3420, 16 heads, 14-pixel patches merged 2 x 2,
windows of 112 pixels, full attention in layers 7, 15, 23 and 31) and its merger into the text model's width.
The processor takes an image near its own size; `--max-pixels` bounds it (the published 12,845,056 lets a photo
through at full size). The text side is the tiny test fixture's (`crates/verity/tests/fixtures/vision/qwen25-vl`:
its tokenizer of 320 ids and its 2 layers of hidden 48) or, with `--text 3b`, Qwen2.5-VL 3B's layers (36 of hidden
2048, MLP 11008, 16 heads of 128, 2 KV heads, multimodal rotary sections [16, 24, 24]; the fixture's 320-id
vocabulary). The tower's time depends on its shapes and the image's size alone, not on the weight values; greedy
text from random weights means nothing.

    python3 tools/bundles/qwen25_vl_shaped.py --out /tmp/bundles/q25vl [--max-pixels 200704] [--text tiny|3b] \
        [--image /tmp/photo.png]

`--image` also writes a 640 x 480 PNG (gradients and seeded noise) to send: a photo's size.

Weights: bf16, one N(0, 0.02) matrix per distinct shape reused by every layer (norm weights 1, biases 0). Needs
numpy; writes safetensors with `gemma3_vl_shaped.py`'s writer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemma3_vl_shaped import Writer, fillers  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "crates/verity/tests/fixtures/vision/qwen25-vl"
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
TEXT_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2)


def write_png(path: Path, rgb: np.ndarray) -> None:
    """`rgb` (height x width x 3, uint8) as an 8-bit RGB PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    h, w, _ = rgb.shape
    rows = b"".join(b"\0" + rgb[y].tobytes() for y in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-pixels", type=int, default=448 * 448)
    ap.add_argument("--text", choices=["tiny", "3b"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    if a.image:
        y, x = np.mgrid[0:480, 0:640]
        rgb = np.stack([x * 255 // 639, y * 255 // 479, (x + y) % 256], -1) + rng.integers(-30, 31, (480, 640, 3))
        write_png(a.image, np.clip(rgb, 0, 255).astype(np.uint8))
    normal, ones, zeros = fillers(a.seed)

    config = json.loads((FIXTURE / "config.json").read_text())
    text = config["text_config"]
    if a.text == "3b":
        text.update(TEXT_3B)
        text["layer_types"] = ["full_attention"] * TEXT_3B["num_hidden_layers"]
        text["rope_parameters"]["mrope_section"] = [16, 24, 24]
    text["max_position_embeddings"] = 32768
    config["vision_config"].update(VISION, out_hidden_size=text["hidden_size"])
    config["dtype"] = "bfloat16"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(config, indent=1))
    pre = json.loads((FIXTURE / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 56 * 56, "longest_edge": a.max_pixels}
    (a.out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(FIXTURE / name, a.out / name)

    h, m, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]
    th, tm, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    nh, kv = text["num_attention_heads"], text["num_key_value_heads"]
    hd = th // nh
    joined = 4 * h
    t = [("visual.patch_embed.proj.weight", (h, 3, 2, p, p), normal)]
    for l in range(VISION["depth"]):
        n = f"visual.blocks.{l}."
        t += [(n + "norm1.weight", (h,), ones), (n + "norm2.weight", (h,), ones),
              (n + "attn.qkv.weight", (3 * h, h), normal), (n + "attn.qkv.bias", (3 * h,), zeros),
              (n + "attn.proj.weight", (h, h), normal), (n + "attn.proj.bias", (h,), zeros)]
        for proj, shape in [("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))]:
            t += [(n + f"mlp.{proj}.weight", shape, normal), (n + f"mlp.{proj}.bias", (shape[0],), zeros)]
    t += [("visual.merger.ln_q.weight", (h,), ones),
          ("visual.merger.mlp.0.weight", (joined, joined), normal), ("visual.merger.mlp.0.bias", (joined,), zeros),
          ("visual.merger.mlp.2.weight", (th, joined), normal), ("visual.merger.mlp.2.bias", (th,), zeros)]
    t += [("model.embed_tokens.weight", (vocab, th), normal), ("model.norm.weight", (th,), ones),
          ("lm_head.weight", (vocab, th), normal)]
    for l in range(text["num_hidden_layers"]):
        n = f"model.layers.{l}."
        t += [(n + "input_layernorm.weight", (th,), ones), (n + "post_attention_layernorm.weight", (th,), ones),
              (n + "self_attn.q_proj.weight", (nh * hd, th), normal), (n + "self_attn.q_proj.bias", (nh * hd,), zeros),
              (n + "self_attn.k_proj.weight", (kv * hd, th), normal), (n + "self_attn.k_proj.bias", (kv * hd,), zeros),
              (n + "self_attn.v_proj.weight", (kv * hd, th), normal), (n + "self_attn.v_proj.bias", (kv * hd,), zeros),
              (n + "self_attn.o_proj.weight", (th, nh * hd), normal),
              (n + "mlp.gate_proj.weight", (tm, th), normal), (n + "mlp.up_proj.weight", (tm, th), normal),
              (n + "mlp.down_proj.weight", (th, tm), normal)]
    Writer(t).write(a.out / "model.safetensors")
    print(f"wrote {a.out}: images up to {a.max_pixels} pixels, text {a.text}")


if __name__ == "__main__":
    main()
