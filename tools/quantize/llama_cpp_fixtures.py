#!/usr/bin/env python3
"""Fixtures for `verity quantize`: what llama.cpp's quantizer writes for two small Llama-shaped models.

Writes each test model's F16 GGUF (the same bytes `crates/verity/tests/quantize.rs` builds in Rust), runs
llama.cpp's `llama_model_quantize` (through llama-cpp-python) on it for every preset verity offers, and records
the SHA-256 of the input, of every output file and of every output tensor's data, with its type:

    python tools/quantize/llama_cpp_fixtures.py --out crates/verity/tests/fixtures/quantize/llama_cpp.json

Needs numpy and llama-cpp-python (the fixtures were made with 0.3.36, built from source on x86-64; its
quantizers are the portable C reference functions, compiled without FMA contraction).

Test values: element i of tensor number t (in the order below) comes from splitmix64's i-th output for seed
1000 + t: the sum of the output's four 16-bit fields, less 131070, times 2^-17 and times the row's scale 2^-(row
mod 5), rounded to F16. Rows with row mod 17 == 5 are zero and rows with row mod 17 == 11 hold one value (the
edge cases of the block quantizers); in rows with row mod 13 == 3 the element at column (7 * row) mod cols is
64 times larger (an outlier). Every step is exact in both languages except the final, round-to-nearest-even,
rounding to F16. Norm weights are F32 ones.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import struct
import tempfile
from pathlib import Path

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MASK16 = np.uint64(0xFFFF)

# name: (layers, d_model, ffn, heads, kv_heads, vocab, tied)
MODELS = {
    # ffn 640 is not a multiple of 256: ffn_down (rows of 640) falls back from the K-quants to 32-blocks.
    "untied": (4, 256, 640, 4, 2, 320, False),
    # No output.weight: the embedding is tied and gets the output's type.
    "tied": (2, 256, 512, 4, 1, 384, True),
}

# verity's preset name: llama.cpp's ftype number
PRESETS = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
    "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "bf16": 32,
}

GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                   12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


def splitmix64(seed: int, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.arange(1, n + 1, dtype=np.uint64) * GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def test_matrix(seed: int, rows: int, cols: int) -> np.ndarray:
    z = splitmix64(seed, rows * cols)
    s = (z & MASK16) + ((z >> np.uint64(16)) & MASK16) + ((z >> np.uint64(32)) & MASK16) + (z >> np.uint64(48))
    n = (s.astype(np.int64) - 131070).reshape(rows, cols)
    r = np.arange(rows)
    scale = np.ldexp(1.0, -17 - (r % 5))
    v = n.astype(np.float64) * scale[:, None]
    v[r % 17 == 5] = 0.0
    const = r % 17 == 11
    v[const] = v[const, :1]
    spike = np.nonzero(r % 13 == 3)[0]
    v[spike, (7 * spike) % cols] *= 64.0
    return v.astype(np.float16)


def model_tensors(spec):
    layers, d, ffn, heads, kv, vocab, tied = spec
    hd = d // heads
    mats = [("token_embd.weight", vocab, d)]
    norms = []
    for i in range(layers):
        norms += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
        mats += [(f"blk.{i}.attn_q.weight", d, d), (f"blk.{i}.attn_k.weight", kv * hd, d),
                 (f"blk.{i}.attn_v.weight", kv * hd, d), (f"blk.{i}.attn_output.weight", d, d),
                 (f"blk.{i}.ffn_gate.weight", ffn, d), (f"blk.{i}.ffn_up.weight", ffn, d),
                 (f"blk.{i}.ffn_down.weight", d, ffn)]
    norms.append("output_norm.weight")
    if not tied:
        mats.append(("output.weight", vocab, d))
    out = []
    for t, (name, rows, cols) in enumerate(mats):
        out.append((name, test_matrix(1000 + t, rows, cols)))
    for name in norms:
        out.append((name, np.ones(d, dtype=np.float32)))
    return out


def gguf_bytes(name: str, spec) -> bytes:
    """A GGUF v3 file: metadata in this order, tensors in model_tensors' order, 32-byte alignment."""
    layers, d, ffn, heads, kv, vocab, tied = spec

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    kvs = [
        ("general.architecture", 8, s("llama")),
        ("general.name", 8, s(f"verity quantize test ({name})")),
        ("llama.block_count", 4, struct.pack("<I", layers)),
        ("llama.context_length", 4, struct.pack("<I", 256)),
        ("llama.embedding_length", 4, struct.pack("<I", d)),
        ("llama.feed_forward_length", 4, struct.pack("<I", ffn)),
        ("llama.attention.head_count", 4, struct.pack("<I", heads)),
        ("llama.attention.head_count_kv", 4, struct.pack("<I", kv)),
        ("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
        ("llama.vocab_size", 4, struct.pack("<I", vocab)),
        ("general.file_type", 4, struct.pack("<I", 1)),
    ]
    tensors = model_tensors(spec)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for key, ty, val in kvs:
        head += s(key) + struct.pack("<I", ty) + val
    data = b""
    for tname, arr in tensors:
        ty = 1 if arr.dtype == np.float16 else 0
        dims = arr.shape[::-1]
        head += s(tname) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", x) for x in dims)
        head += struct.pack("<IQ", ty, len(data))
        raw = arr.tobytes()
        data += raw + b"\0" * (-len(raw) % 32)
    head += b"\0" * (-len(head) % 32)
    return head + data


def read_tensors(path: Path):
    """(name, ggml type name, sha256 of data) for every tensor of a GGUF file, in file order."""
    import gguf  # gguf-py reads what llama.cpp wrote

    r = gguf.GGUFReader(path)
    return [
        {"name": t.name, "type": GGML_TYPE_NAMES[int(t.tensor_type)],
         "sha256": hashlib.sha256(t.data.tobytes()).hexdigest()}
        for t in r.tensors
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", help="also keep the input and output GGUFs in this folder")
    args = ap.parse_args()

    import llama_cpp

    record = {"llama_cpp_python": llama_cpp.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name, spec in MODELS.items():
            src = folder / f"{name}-input.gguf"
            src.write_bytes(gguf_bytes(name, spec))
            entry = {"input_sha256": hashlib.sha256(src.read_bytes()).hexdigest(), "presets": {}}
            for preset, ftype in PRESETS.items():
                dst = folder / f"{name}-{preset}.gguf"
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype = ftype
                params.nthread = 2
                rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
                if rc != 0:
                    raise SystemExit(f"llama_model_quantize {name} {preset} failed with status {rc}")
                body = dst.read_bytes()
                entry["presets"][preset] = {
                    "sha256": hashlib.sha256(body).hexdigest(),
                    "bytes": len(body),
                    "tensors": read_tensors(dst),
                }
            record["models"][name] = entry
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
