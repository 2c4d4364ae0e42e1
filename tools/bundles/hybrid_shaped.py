#!/usr/bin/env python3
"""Qwen3-Next-shaped model bundles with random weights: Gated DeltaNet layers between gated full-attention ones,
a mixture of experts with a shared expert, for speed tables of hybrid models at a size a CPU runs.

    python tools/bundles/hybrid_shaped.py --shape mini --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf \\
        --format mlx4 --out /tmp/bundles/qwen3-next-mini-mlx4

Shapes: `mini` has Qwen3-Next-80B-A3B's per-layer geometry (d_model 2048; linear attention of 16 key heads and
32 value heads of 128 with a convolution of 4; full attention of 16 heads / 2 KV heads of 256 with RoPE on a
quarter of each head and an output gate; every fourth layer full attention; experts of 512 units and a shared
expert of 512) at 12 layers and 32 experts (10 per token) instead of 48 and 512, so that it fits a laptop.
`tiny` is the same at d_model 256 for quick checks. The vocabulary is the tokenizer's.

Formats: `mlx4` / `mlx8` (an MLX folder, every projection affine-quantized with groups of 64; the convolution,
decay rates, time-step biases and norms float16), `f16` (float16 safetensors, as Hugging Face saves the model),
`gguf-q4_0` / `gguf-q8_0` / `gguf-f16` (a `qwen3next` GGUF as llama.cpp's converter lays it out — see
scripts/fixtures/make_hybrid_bundles.py —, projections in that type, the rest f32; `--out` is the file).
Weights as in llama_shaped.py: one N(0, 0.02) matrix per distinct shape, reused; norm weights 0 (stored as
`w - 1`, so the norms scale by 1); the output rows of control tokens zero, so greedy decoding runs its budget.

Needs numpy and gguf (gguf-py; tested with 0.19).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_shaped import (  # noqa: E402
    GGUF_TYPES, MLX_BITS, MLX_GROUP, control_ids, gguf_encoder, log, mlx_encoder, random_matrix,
    tokenizer_fields, write_safetensors, write_tokenizer_files)

SHAPES = {
    # layers, d_model, linear (key heads, value heads, head dim), full (heads, kv heads, head dim),
    # experts, experts per token, expert units, shared units
    "tiny": (4, 256, (2, 4, 64), (4, 2, 64), 8, 2, 128, 128),
    "mini": (12, 2048, (16, 32, 128), (16, 2, 256), 32, 10, 512, 512),
}
FULL_EVERY = 4
CONV = 4
ROPE_THETA = 10_000_000.0
RMS_EPS = 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--tokenizer", required=True, metavar="GGUF", help="a GGUF whose vocabulary the bundle uses")
    ap.add_argument("--format", choices=[*MLX_BITS, "f16", *(f"gguf-{t}" for t in GGUF_TYPES)], default="mlx4")
    ap.add_argument("--out", required=True, help="the bundle folder (a GGUF format: the file)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    shape = SHAPES[args.shape]
    n_layers, d, (kh, vh, lhd), (heads, kv, hd), experts, top_k, ffn, shared = shape
    tok = tokenizer_fields(gguf.GGUFReader(args.tokenizer))
    tokens = tok["tokenizer.ggml.tokens"][0]
    vocab = len(tokens)
    if args.format.startswith("gguf-"):
        write_gguf(args, shape, tok, vocab)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    quantized = args.format in MLX_BITS
    encode = mlx_encoder(MLX_BITS[args.format]) if quantized else (lambda block: block.astype(np.float16))
    cache: dict = {}
    tensors: list[tuple[str, np.ndarray]] = []

    def project(module: str, rows: int, cols: int, zero_rows=()):
        key = (rows, cols, bool(zero_rows))
        if key not in cache:
            cache[key] = random_matrix(rows, cols, args.seed, encode, zero_rows)
        m = cache[key]
        if quantized:
            words, scales, biases = m
            tensors.extend([(f"{module}.weight", words), (f"{module}.scales", scales), (f"{module}.biases", biases)])
        else:
            tensors.append((f"{module}.weight", m))

    def small(name: str, values: np.ndarray):
        tensors.append((name, values.astype(np.float16)))

    rng = np.random.default_rng(args.seed)
    zeros = np.zeros(d, dtype=np.float16)
    project("model.embed_tokens", vocab, d)
    conv_channels = 2 * kh * lhd + vh * lhd
    for layer in range(n_layers):
        p = f"model.layers.{layer}"
        small(f"{p}.input_layernorm.weight", zeros)
        small(f"{p}.post_attention_layernorm.weight", zeros)
        if (layer + 1) % FULL_EVERY:
            a = f"{p}.linear_attn"
            project(f"{a}.in_proj_qkvz", 2 * kh * lhd + 2 * vh * lhd, d)
            project(f"{a}.in_proj_ba", 2 * vh, d)
            project(f"{a}.out_proj", d, vh * lhd)
            small(f"{a}.conv1d.weight", rng.normal(0, 0.5, (conv_channels, 1, CONV)))
            small(f"{a}.A_log", np.log(rng.uniform(1, 16, vh)))
            small(f"{a}.dt_bias", np.ones(vh))
            small(f"{a}.norm.weight", np.ones(lhd))
        else:
            a = f"{p}.self_attn"
            project(f"{a}.q_proj", 2 * heads * hd, d)
            project(f"{a}.k_proj", kv * hd, d)
            project(f"{a}.v_proj", kv * hd, d)
            project(f"{a}.o_proj", d, heads * hd)
            small(f"{a}.q_norm.weight", np.zeros(hd))
            small(f"{a}.k_norm.weight", np.zeros(hd))
        m = f"{p}.mlp"
        project(f"{m}.gate", experts, d)
        for e in range(experts):
            project(f"{m}.experts.{e}.gate_proj", ffn, d)
            project(f"{m}.experts.{e}.up_proj", ffn, d)
            project(f"{m}.experts.{e}.down_proj", d, ffn)
        project(f"{m}.shared_expert.gate_proj", shared, d)
        project(f"{m}.shared_expert.up_proj", shared, d)
        project(f"{m}.shared_expert.down_proj", d, shared)
        project(f"{m}.shared_expert_gate", 1, d)
    small("model.norm.weight", zeros)
    project("lm_head", vocab, d, zero_rows=control_ids(tok))
    write_safetensors(out / "model.safetensors", tensors, {"format": "mlx" if quantized else "pt"})

    token = lambda key: tok[key][0] if key in tok else None  # noqa: E731
    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
        "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab,
        "rms_norm_eps": RMS_EPS, "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25,
        "full_attention_interval": FULL_EVERY, "max_position_embeddings": args.context,
        "linear_num_key_heads": kh, "linear_num_value_heads": vh, "linear_key_head_dim": lhd,
        "linear_value_head_dim": lhd, "linear_conv_kernel_dim": CONV, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": ffn, "shared_expert_intermediate_size": shared,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        "torch_dtype": "float16", "bos_token_id": bos, "eos_token_id": eos,
    }
    if quantized:
        config["quantization"] = config["quantization_config"] = {"group_size": MLX_GROUP,
                                                                  "bits": MLX_BITS[args.format]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(out, tok)
    log(f"wrote {out}: {n_layers} layers, d_model {d}, vocab {vocab}, {len(tensors)} tensors")


def write_gguf(args, shape, tok, vocab: int) -> None:
    n_layers, d, (kh, vh, lhd), (heads, kv, hd), experts, top_k, ffn, shared = shape
    qtype, ftype = GGUF_TYPES[args.format.removeprefix("gguf-")]
    encode = gguf_encoder(qtype)
    raw = None if qtype == gguf.GGMLQuantizationType.F16 else qtype
    cache: dict = {}

    def matrix(rows, cols, zero_rows=()):
        key = (rows, cols, bool(zero_rows))
        if key not in cache:
            cache[key] = random_matrix(rows, cols, args.seed, encode, zero_rows)
        return cache[key]

    w = gguf.GGUFWriter(args.out, "qwen3next")
    w.add_name(f"random qwen3-next-{args.shape}-shaped")
    w.add_block_count(n_layers)
    w.add_context_length(args.context)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_rope_dimension_count(hd // 4)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_expert_feed_forward_length(ffn)
    w.add_expert_shared_feed_forward_length(shared)
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_state_size(lhd)
    w.add_ssm_group_count(kh)
    w.add_ssm_time_step_rank(vh)
    w.add_ssm_inner_size(vh * lhd)
    w.add_full_attention_interval(FULL_EVERY)
    w.add_file_type(ftype)
    if raw is not None:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (value, vtype, sub) in tok.items():
        w.add_key_value(name, value, vtype, sub_type=sub)

    rng = np.random.default_rng(args.seed)
    ones = np.ones(d, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(vocab, d), raw_dtype=raw)
    conv_channels = 2 * kh * lhd + vh * lhd
    # Stacked experts share one matrix each (what they hold does not change the speed).
    stack = lambda m: np.stack([m] * experts)  # noqa: E731
    gate_up, down = stack(matrix(ffn, d)), stack(matrix(d, ffn))
    for layer in range(n_layers):
        b = f"blk.{layer}"
        w.add_tensor(f"{b}.attn_norm.weight", ones)
        w.add_tensor(f"{b}.post_attention_norm.weight", ones)
        if (layer + 1) % FULL_EVERY:
            w.add_tensor(f"{b}.attn_qkv.weight", matrix(2 * kh * lhd + vh * lhd, d), raw_dtype=raw)
            w.add_tensor(f"{b}.attn_gate.weight", matrix(vh * lhd, d), raw_dtype=raw)
            w.add_tensor(f"{b}.ssm_ba.weight", matrix(2 * vh, d), raw_dtype=raw)
            w.add_tensor(f"{b}.ssm_out.weight", matrix(d, vh * lhd), raw_dtype=raw)
            w.add_tensor(f"{b}.ssm_conv1d.weight", rng.normal(0, 0.5, (conv_channels, CONV)).astype(np.float32))
            w.add_tensor(f"{b}.ssm_a", -rng.uniform(1, 16, vh).astype(np.float32))
            w.add_tensor(f"{b}.ssm_dt.bias", np.ones(vh, dtype=np.float32))
            w.add_tensor(f"{b}.ssm_norm.weight", np.ones(lhd, dtype=np.float32))
        else:
            w.add_tensor(f"{b}.attn_q.weight", matrix(2 * heads * hd, d), raw_dtype=raw)
            w.add_tensor(f"{b}.attn_k.weight", matrix(kv * hd, d), raw_dtype=raw)
            w.add_tensor(f"{b}.attn_v.weight", matrix(kv * hd, d), raw_dtype=raw)
            w.add_tensor(f"{b}.attn_output.weight", matrix(d, heads * hd), raw_dtype=raw)
            w.add_tensor(f"{b}.attn_q_norm.weight", np.ones(hd, dtype=np.float32))
            w.add_tensor(f"{b}.attn_k_norm.weight", np.ones(hd, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate_inp.weight", matrix(experts, d), raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_gate_exps.weight", gate_up, raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_up_exps.weight", gate_up, raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_down_exps.weight", down, raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_gate_inp_shexp.weight", np.full(d, 0.02, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_gate_shexp.weight", matrix(shared, d), raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_up_shexp.weight", matrix(shared, d), raw_dtype=raw)
        w.add_tensor(f"{b}.ffn_down_shexp.weight", matrix(d, shared), raw_dtype=raw)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", matrix(vocab, d, zero_rows=control_ids(tok)), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    log(f"wrote {args.out}: {n_layers} layers, d_model {d}, vocab {vocab}, {args.format}")


if __name__ == "__main__":
    main()
