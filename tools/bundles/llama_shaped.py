#!/usr/bin/env python3
"""Llama-shaped (and Gemma-3-shaped) model bundles with random weights, for speed tables at real model sizes.

Decode speed depends on a model's shapes and weight format, not on its weight values, so a bundle of the
right shape filled with random numbers measures what the real model would. Anyone can rebuild these
bundles from this script and a small GGUF that lends its tokenizer; no multi-gigabyte download needed.

    python tools/bundles/llama_shaped.py --shape 1b --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf \\
        --format f16 --out /tmp/bundles/1b-f16.gguf [--quantize q4_k_m --threads 8]
    python tools/bundles/llama_shaped.py --shape 8b --tokenizer T.gguf --format mlx4 --out /tmp/bundles/8b-mlx4
    python tools/bundles/llama_shaped.py --shape tokenizer --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out /tmp/bundles/smollm2-tokenizer.gguf          # 2 MB: what --tokenizer needs, for carrying

Shapes (layers, d_model, ffn, heads, kv heads, head dim): tiny 2/256/512/4/2/64 (quick tests),
135m 30/576/1536/9/3/64 (SmolLM2-135M's, where its real weights cannot be carried), gemma3-270m
18/640/2048/4/1/256 (Gemma 3 270M's, GGUF only: architecture gemma3, Q/K norms and post-norms, tied embeddings,
local layers with a 512-token window, RoPE base 1e6, RMS epsilon 1e-6; pass its tokenizer), 1b 16/2048/8192/32/8/64, 3b 28/3072/8192/24/8/128, 8b 32/4096/14336/32/8/128 (the Llama 3.2 1B/3B and
Llama 3.1 8B shapes). RoPE base 500000, RMS epsilon 1e-5, context 8192 (--context). The output matrix is
untied from the embedding. The vocabulary, and so the embedding and output shapes, are the tokenizer's.

Formats:
  f16        GGUF, F16 matrices and F32 norms: the input to a quantizer (llama.cpp's: --quantize).
  q4_0, q8_0 GGUF, quantized here with gguf-py (gguf.quants).
  mlx4, mlx8 an MLX folder: config.json (model_type llama, quantization {group_size 64, bits 4|8}),
             model.safetensors (uint32-packed weights with f16 scales and biases, the embedding too, f16 norms),
             tokenizer.json and tokenizer_config.json.
--quantize q4_k_m|q5_k_m|q6_k|q4_0|q8_0 (with --format f16) also runs llama.cpp's quantizer through
llama-cpp-python, writing OUT's stem + "-q4_k_m.gguf" beside the F16 file, which is kept.

The MLX folder's tokenizer.json is built from the GGUF's vocabulary the way verity builds it for GGUF
bundles (byte-level BPE vocabularies, tokenizer.ggml.model "gpt2", with the pre-tokenizers verity knows), so
both bundles tokenize alike. For other vocabularies pass the model's own file with --tokenizer-json.

Weights: one N(0, 0.02) matrix per distinct shape, seeded (--seed) and reused by every layer that has that
shape, so writing costs little more than the disk's time and the same numpy writes the same bytes. Norm
weights are 1. The output rows of the end-of-sequence token and of every control token are zero: their
logits are 0 while the largest of the other logits is positive, so greedy decoding never stops early and
every run decodes its full token budget. Greedy output of random weights soon repeats itself, which flatters
copy-style speculation: time one-token (AR) decode with these bundles, not speculative speed-ups.

Needs numpy and gguf (gguf-py; tested with 0.19).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

SHAPES = {  # layers, d_model, ffn, heads, kv_heads, head_dim
    "tiny": (2, 256, 512, 4, 2, 64),
    "135m": (30, 576, 1536, 9, 3, 64),
    "gemma3-270m": (18, 640, 2048, 4, 1, 256),
    "1b": (16, 2048, 8192, 32, 8, 64),
    "3b": (28, 3072, 8192, 24, 8, 128),
    "8b": (32, 4096, 14336, 32, 8, 128),
}
ROPE_THETA = 500000.0
RMS_EPS = 1e-5
# Gemma 3's: the global layers' RoPE base, its RMS epsilon, the local layers' window.
GEMMA3 = {"rope_theta": 1e6, "rms_eps": 1e-6, "sliding_window": 512}
STD = 0.02
ROWS_PER_CHUNK = 1024  # generation granularity: bounds the float32 scratch for a large vocabulary

GGUF_TYPES = {"f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16), "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
              "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
MLX_BITS = {"mlx4": 4, "mlx8": 8}
MLX_GROUP = 64
# llama.cpp's llama_ftype values.
LLAMA_FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
TOKEN_TYPE_CONTROL = 3

# The pre-tokenizers of verity's GGUF vocabulary conversion (crates/verity/src/chat/gguf_vocab.rs).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- weights


def random_matrix(rows: int, cols: int, seed: int, encode, zero_rows=()) -> np.ndarray:
    """An N(0, STD) [rows, cols] matrix, encoded chunk by chunk so that only the encoded form is ever whole.

    The generator is keyed by (seed, shape), so a matrix does not depend on which other shapes the model has.
    """
    rng = np.random.default_rng([seed, rows, cols])
    zero_rows = np.asarray(sorted(zero_rows), dtype=np.int64)
    parts = []
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        block = rng.standard_normal((n, cols), dtype=np.float32)
        block *= STD
        hit = zero_rows[(zero_rows >= start) & (zero_rows < start + n)]
        block[hit - start] = 0.0
        parts.append(encode(block))
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(np.concatenate(p) for p in zip(*parts))
    return np.concatenate(parts)


def gguf_encoder(qtype: QT):
    if qtype == QT.F16:
        return lambda block: block.astype(np.float16)
    return lambda block: gguf.quants.quantize(block, qtype)


def mlx_encoder(bits: int):
    """MLX affine quantization of each group of MLX_GROUP values: w ≈ scale * q + bias, q unsigned `bits`-bit,
    packed little-end first into uint32 words (element k of a word at bits k*bits), as mlx.core.quantize lays it
    out and verity's quant/mlx.rs reads it. Scales are plain min/max; how they are chosen costs nothing at
    decode time."""
    levels = (1 << bits) - 1
    per_word = 32 // bits

    def encode(block: np.ndarray):
        rows, cols = block.shape
        g = block.reshape(rows, cols // MLX_GROUP, MLX_GROUP)
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        scale = ((hi - lo) / levels).astype(np.float16)
        bias = lo.astype(np.float16)
        s32 = scale.astype(np.float32)
        s32[s32 == 0] = 1.0  # an all-zero group (a zeroed output row): q = 0, scale 0, bias 0 decodes to 0
        q = np.rint((g - bias.astype(np.float32)[..., None]) / s32[..., None])
        q = np.clip(q, 0, levels).astype(np.uint32).reshape(rows, cols // per_word, per_word)
        shifts = np.arange(per_word, dtype=np.uint32) * bits
        words = np.bitwise_or.reduce(q << shifts, axis=-1).astype("<u4")
        return words, scale, bias

    return encode


# ---------------------------------------------------------------- tokenizer


def tokenizer_fields(reader: gguf.GGUFReader) -> dict:
    """Every tokenizer.* key of a GGUF file: name -> (value, type, array element type)."""
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
            out[name] = (f.contents(), vtype, sub)
    return out


def control_ids(tok: dict) -> set[int]:
    ids = set()
    if "tokenizer.ggml.token_type" in tok:
        ids |= {i for i, t in enumerate(tok["tokenizer.ggml.token_type"][0]) if t == TOKEN_TYPE_CONTROL}
    if "tokenizer.ggml.eos_token_id" in tok:
        ids.add(int(tok["tokenizer.ggml.eos_token_id"][0]))
    return ids


def tokenizer_json(tok: dict) -> dict:
    """The tokenizer.json verity builds from GGUF vocabulary metadata (chat/gguf_vocab.rs), for gpt2-model
    (byte-level BPE) vocabularies."""
    model = tok.get("tokenizer.ggml.model", ("",))[0]
    pre = tok.get("tokenizer.ggml.pre", ("default",))[0]
    if model != "gpt2":
        raise SystemExit(f"tokenizer model {model!r}: only gpt2 (byte-level BPE) vocabularies convert; "
                         "pass the model's tokenizer.json with --tokenizer-json")

    def byte_level(use_regex):
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}

    def split(pattern):
        return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}

    if pre in ("default", "gpt-2", "gpt2"):
        pre_tok = byte_level(True)
    elif pre == "smollm":
        pre_tok = {"type": "Sequence",
                   "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level(True)]}
    elif pre in ("llama-bpe", "llama3"):
        pre_tok = {"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(False)]}
    elif pre == "qwen2":
        pre_tok = {"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(False)]}
    else:
        raise SystemExit(f"GGUF pre-tokenizer {pre!r} is not one verity converts; pass --tokenizer-json")
    tokens = tok["tokenizer.ggml.tokens"][0]
    types = tok.get("tokenizer.ggml.token_type", ([1] * len(tokens),))[0]
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t == TOKEN_TYPE_CONTROL}
             for i, (s, t) in enumerate(zip(tokens, types)) if t in (TOKEN_TYPE_CONTROL, 4)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tok, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {s: i for i, s in enumerate(tokens)}, "merges": tok["tokenizer.ggml.merges"][0]},
    }


# ---------------------------------------------------------------- writers


def layer_shapes(shape):
    """(GGUF suffix, HF module, rows, cols) of each matrix of a layer."""
    _, d, ffn, heads, kv, hd = shape
    return [("attn_q", "self_attn.q_proj", heads * hd, d), ("attn_k", "self_attn.k_proj", kv * hd, d),
            ("attn_v", "self_attn.v_proj", kv * hd, d), ("attn_output", "self_attn.o_proj", d, heads * hd),
            ("ffn_gate", "mlp.gate_proj", ffn, d), ("ffn_up", "mlp.up_proj", ffn, d),
            ("ffn_down", "mlp.down_proj", d, ffn)]


def write_gguf(args, shape, tok, vocab: int, zero_rows: set[int]) -> None:
    n_layers, d, ffn, heads, kv, hd = shape
    qtype, ftype = GGUF_TYPES[args.format]
    encode = gguf_encoder(qtype)
    cache: dict = {}

    def matrix(rows, cols):
        if (rows, cols) not in cache:
            cache[rows, cols] = random_matrix(rows, cols, args.seed, encode)
        return cache[rows, cols]

    gemma = args.shape.startswith("gemma3")
    w = gguf.GGUFWriter(args.out, "gemma3" if gemma else "llama")
    w.add_name(f"random {args.shape}-shaped")
    w.add_block_count(n_layers)
    w.add_context_length(args.context)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    if gemma:
        w.add_rope_freq_base(GEMMA3["rope_theta"])
        w.add_layer_norm_rms_eps(GEMMA3["rms_eps"])
        w.add_uint32("gemma3.attention.sliding_window", GEMMA3["sliding_window"])
    else:
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(ROPE_THETA)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_vocab_size(vocab)
    w.add_file_type(ftype)
    if qtype != QT.F16:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (value, vtype, sub) in tok.items():
        w.add_key_value(name, value, vtype, sub_type=sub)

    # The writer keeps references, not copies: a matrix shared by every layer is held once.
    raw = None if qtype == QT.F16 else qtype
    ones = np.ones(d, dtype=np.float32)
    # Gemma ties the output to the embedding, so the embedding carries the zero rows.
    embedding = random_matrix(vocab, d, args.seed, encode, zero_rows) if gemma else matrix(vocab, d)
    w.add_tensor("token_embd.weight", embedding, raw_dtype=raw)
    for layer in range(n_layers):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
        if gemma:
            head_ones = np.ones(hd, dtype=np.float32)
            w.add_tensor(f"blk.{layer}.attn_q_norm.weight", head_ones)
            w.add_tensor(f"blk.{layer}.attn_k_norm.weight", head_ones)
            w.add_tensor(f"blk.{layer}.post_attention_norm.weight", ones)
            w.add_tensor(f"blk.{layer}.post_ffw_norm.weight", ones)
        for suffix, _, rows, cols in layer_shapes(shape):
            w.add_tensor(f"blk.{layer}.{suffix}.weight", matrix(rows, cols), raw_dtype=raw)
    w.add_tensor("output_norm.weight", ones)
    if not gemma:
        w.add_tensor("output.weight", random_matrix(vocab, d, args.seed, encode, zero_rows), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_mlx(args, shape, tok, vocab: int, zero_rows: set[int]) -> None:
    n_layers, d, ffn, heads, kv, hd = shape
    bits = MLX_BITS[args.format]
    encode = mlx_encoder(bits)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache: dict = {}

    def matrix(rows, cols):
        if (rows, cols) not in cache:
            cache[rows, cols] = random_matrix(rows, cols, args.seed, encode)
        return cache[rows, cols]

    tensors: list[tuple[str, np.ndarray]] = []

    def add_quantized(module, parts):
        words, scales, biases = parts
        tensors.extend([(f"{module}.weight", words), (f"{module}.scales", scales), (f"{module}.biases", biases)])

    ones = np.ones(d, dtype=np.float16)
    add_quantized("model.embed_tokens", matrix(vocab, d))
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}"
        tensors.append((f"{prefix}.input_layernorm.weight", ones))
        tensors.append((f"{prefix}.post_attention_layernorm.weight", ones))
        for _, module, rows, cols in layer_shapes(shape):
            add_quantized(f"{prefix}.{module}", matrix(rows, cols))
    tensors.append(("model.norm.weight", ones))
    add_quantized("lm_head", random_matrix(vocab, d, args.seed, encode, zero_rows))
    write_safetensors(out / "model.safetensors", tensors, {"format": "mlx"})

    token = lambda key: tok[key][0] if key in tok else None  # noqa: E731
    tokens = tok["tokenizer.ggml.tokens"][0]
    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    quant = {"group_size": MLX_GROUP, "bits": bits}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab,
        "rms_norm_eps": RMS_EPS, "rope_theta": ROPE_THETA, "max_position_embeddings": args.context,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
        "bos_token_id": bos, "eos_token_id": eos, "quantization": quant, "quantization_config": quant,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(out, tok, args.tokenizer_json)


def write_tokenizer_files(out: Path, tok: dict, tokenizer_json_path: str | None = None) -> None:
    """A Hugging Face folder's tokenizer_config.json and tokenizer.json for the GGUF vocabulary `tok` (or the
    given tokenizer.json)."""
    token = lambda key: tok[key][0] if key in tok else None  # noqa: E731
    tokens = tok["tokenizer.ggml.tokens"][0]
    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    tok_config = {"add_bos_token": bool(token("tokenizer.ggml.add_bos_token")),
                  "bos_token": tokens[bos] if bos is not None else None,
                  "eos_token": tokens[eos] if eos is not None else None,
                  "chat_template": token("tokenizer.chat_template")}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    if tokenizer_json_path:
        (out / "tokenizer.json").write_bytes(Path(tokenizer_json_path).read_bytes())
    else:
        (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(tok), ensure_ascii=False))


def write_safetensors(path: Path, tensors, metadata: dict) -> None:
    """Safetensors by hand: u64 header length, JSON header (padded to 8 bytes), then the tensors' bytes in
    header order, each written straight from its array."""
    dtypes = {np.dtype("<u4"): "U32", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, a in tensors:
        header[name] = {"dtype": dtypes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors:
            np.ascontiguousarray(a).tofile(f)


def llama_quantize(f16_path: str, kind: str, threads: int) -> str:
    import ctypes
    import llama_cpp  # checked in main() before the F16 write

    out = str(Path(f16_path).with_name(f"{Path(f16_path).stem}-{kind}.gguf"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[kind]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(f16_path.encode(), out.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with status {rc}")
    return out


def main() -> None:
    summary, details = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=summary, epilog=details,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=[*SHAPES, "tokenizer"], required=True,
                    help="model shape (see below); `tokenizer`: a GGUF of the tokenizer.* keys alone, no tensors "
                         "(a 2 MB stand-in for --tokenizer where the full model file is too large to carry)")
    ap.add_argument("--tokenizer", required=True, metavar="GGUF",
                    help="a GGUF file whose tokenizer.* metadata (vocabulary, merges, chat template) is copied")
    ap.add_argument("--format", choices=[*GGUF_TYPES, *MLX_BITS], default="f16", help="weight format (default f16)")
    ap.add_argument("--out", required=True, help="the .gguf file, or the folder of an MLX bundle")
    ap.add_argument("--context", type=int, default=8192, help="declared context length (default 8192)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--tokenizer-json", metavar="PATH",
                    help="MLX formats: the model's tokenizer.json, instead of one converted from the GGUF")
    ap.add_argument("--quantize", choices=LLAMA_FTYPES,
                    help="with --format f16: also quantize with llama.cpp (llama-cpp-python) to OUT-stem-KIND.gguf")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp quantizer threads (default 0: all cores)")
    args = ap.parse_args()
    if args.quantize and args.format != "f16":
        ap.error("--quantize reads the F16 file: use it with --format f16")
    if args.quantize:  # fail before the long write, not after it
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--quantize needs llama-cpp-python (pip install llama-cpp-python): {e}")

    tok = tokenizer_fields(gguf.GGUFReader(args.tokenizer))
    if "tokenizer.ggml.tokens" not in tok:
        raise SystemExit(f"{args.tokenizer} has no tokenizer.ggml.tokens")
    if args.shape == "tokenizer":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(args.out, "llama")
        for name, (value, vtype, sub) in tok.items():
            w.add_key_value(name, value, vtype, sub_type=sub)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        log(f"wrote {args.out} (the tokenizer of {args.tokenizer})")
        return
    shape = SHAPES[args.shape]
    if args.shape.startswith("gemma3") and args.format in MLX_BITS:
        ap.error("the Gemma 3 shape is written as GGUF only")
    vocab = len(tok["tokenizer.ggml.tokens"][0])
    zero_rows = control_ids(tok)

    t0 = time.perf_counter()
    if args.format in MLX_BITS:
        write_mlx(args, shape, tok, vocab, zero_rows)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_gguf(args, shape, tok, vocab, zero_rows)
    log(f"wrote {args.out} ({args.shape}, {args.format}, vocab {vocab}) in {time.perf_counter() - t0:.1f} s")
    if args.quantize:
        t0 = time.perf_counter()
        q = llama_quantize(args.out, args.quantize, args.threads)
        log(f"wrote {q} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
