#!/usr/bin/env python3
"""A Gemma 3 image-text folder with random weights and a real vision tower's shapes, to time image turns.

The vision side is Gemma 3's SigLIP (27 layers, hidden 1152, MLP 4304, 16 heads, 14-pixel patches) and its
projector into 256 image tokens; `--image-size` sets the pixels per side (896 in the published checkpoints). The
text side is the tiny test fixture's (`crates/verity/tests/fixtures/vision/gemma3-vl`: its tokenizer of 320 ids
and its 2 layers of hidden 48) or, with `--text 4b`, Gemma 3 4B's layers (34 of hidden 2560, MLP 10240, 8 heads
of 256, 4 KV heads; the fixture's 320-id vocabulary). The tower's time depends on its shapes alone, not on the
weight values; greedy text from random weights means nothing.

    python3 tools/bundles/gemma3_vl_shaped.py --out /tmp/bundles/g3vl [--image-size 896] [--text tiny|4b]

Weights: bf16, one N(0, 0.02) matrix per distinct shape reused by every layer (norm weights 1, biases 0), so
writing costs little more than the disk's time. Needs numpy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[2] / "crates/verity/tests/fixtures/vision/gemma3-vl"
VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14)
TEXT_4B = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256)


def bf16(a: np.ndarray) -> bytes:
    """Round-to-nearest-even bf16 of float32 values, little-endian."""
    bits = a.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


class Writer:
    """A safetensors file written tensor by tensor (header first: names, shapes and offsets known ahead)."""

    def __init__(self, tensors: list[tuple[str, tuple[int, ...], callable]]):
        self.tensors = tensors

    def write(self, path: Path) -> None:
        header, offset = {}, 0
        for name, shape, _ in self.tensors:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, shape, make in self.tensors:
                f.write(make(shape))


def fillers(seed: int):
    """Writers of a tensor's bf16 bytes by shape: N(0, 0.02) (one matrix per distinct shape, seeded), ones, zeros."""
    rng = np.random.default_rng(seed)
    cache: dict[tuple[int, ...], bytes] = {}

    def normal(shape):
        if shape not in cache:
            cache[shape] = bf16(rng.standard_normal(shape, dtype=np.float32) * 0.02)
        return cache[shape]

    def ones(shape):
        return bf16(np.ones(shape, np.float32))

    def zeros(shape):
        return bf16(np.zeros(shape, np.float32))

    return normal, ones, zeros


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--image-size", type=int, default=896)
    ap.add_argument("--text", choices=["tiny", "4b"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    normal, ones, zeros = fillers(a.seed)

    config = json.loads((FIXTURE / "config.json").read_text())
    text = config["text_config"]
    if a.text == "4b":
        text.update(TEXT_4B)
        text["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
        text["layer_types"] = (text["layer_types"] * 6)[: TEXT_4B["num_hidden_layers"]]
        text["sliding_window"] = 1024
    text["max_position_embeddings"] = 8192
    s, p = a.image_size, VISION["patch_size"]
    assert s % p == 0 and (s // p) % 16 == 0, "the patches must pool into 16 x 16 tokens"
    config["vision_config"].update(VISION, image_size=s)
    config["mm_tokens_per_image"] = 256
    config["dtype"] = "bfloat16"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(config, indent=1))
    pre = json.loads((FIXTURE / "preprocessor_config.json").read_text())
    pre["size"] = {"height": s, "width": s}
    (a.out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(FIXTURE / name, a.out / name)

    h, m = VISION["hidden_size"], VISION["intermediate_size"]
    th, tm, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    hd, nh, kv = text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]
    t = []
    v = "vision_tower.vision_model."
    t += [(v + "embeddings.patch_embedding.weight", (h, 3, p, p), normal),
          (v + "embeddings.patch_embedding.bias", (h,), zeros),
          (v + "embeddings.position_embedding.weight", ((s // p) ** 2, h), normal)]
    for l in range(VISION["num_hidden_layers"]):
        n = f"{v}encoder.layers.{l}."
        for ln in ["layer_norm1", "layer_norm2"]:
            t += [(n + ln + ".weight", (h,), ones), (n + ln + ".bias", (h,), zeros)]
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"]:
            t += [(n + f"self_attn.{proj}.weight", (h, h), normal), (n + f"self_attn.{proj}.bias", (h,), zeros)]
        t += [(n + "mlp.fc1.weight", (m, h), normal), (n + "mlp.fc1.bias", (m,), zeros),
              (n + "mlp.fc2.weight", (h, m), normal), (n + "mlp.fc2.bias", (h,), zeros)]
    t += [(v + "post_layernorm.weight", (h,), ones), (v + "post_layernorm.bias", (h,), zeros),
          ("multi_modal_projector.mm_soft_emb_norm.weight", (h,), zeros),
          ("multi_modal_projector.mm_input_projection_weight", (h, th), normal)]
    lm = "language_model.model."
    t += [(lm + "embed_tokens.weight", (vocab, th), normal), (lm + "norm.weight", (th,), zeros)]
    for l in range(text["num_hidden_layers"]):
        n = f"{lm}layers.{l}."
        for norm in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"]:
            t.append((n + norm + ".weight", (th,), zeros))
        t += [(n + "self_attn.q_norm.weight", (hd,), zeros), (n + "self_attn.k_norm.weight", (hd,), zeros),
              (n + "self_attn.q_proj.weight", (nh * hd, th), normal),
              (n + "self_attn.k_proj.weight", (kv * hd, th), normal),
              (n + "self_attn.v_proj.weight", (kv * hd, th), normal),
              (n + "self_attn.o_proj.weight", (th, nh * hd), normal),
              (n + "mlp.gate_proj.weight", (tm, th), normal), (n + "mlp.up_proj.weight", (tm, th), normal),
              (n + "mlp.down_proj.weight", (th, tm), normal)]
    Writer(t).write(a.out / "model.safetensors")
    print(f"wrote {a.out}: {s}-pixel images, {(s // p) ** 2} patches, text {a.text}")


if __name__ == "__main__":
    main()
