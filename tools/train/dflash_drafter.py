"""The block drafter (DFlash layout, the contract verity's runtime loads from a bundle's `drafter/`) in PyTorch.

Context: for each committed position p, the target's residual streams after the layers `target_layers` are
concatenated and fused, c_p = rmsnorm(fc([h_a; h_b; ...]), hidden_norm). A block [t_n, m, m, ...] (the pending
token at position n, then the mask token) is embedded with the target's embedding and runs through the drafter
layers: x̂ = rmsnorm(x, input_layernorm); Q = q_norm(q_proj(x̂)) per head; K = k_norm(k_proj(·)) and V = v_proj(·)
of both the context c (positions < n) and x̂; rotate-half RoPE at each row's position; attention of the block's
queries over all context keys and all the block's keys (no causal order inside the block); o_proj; residual;
post_attention_layernorm; SwiGLU MLP; residual. Then rmsnorm(x, norm) and the target's output matrix: mask row i
is the drafter's distribution for the token at n + i.

`forward_blocks` trains many blocks of a sequence at once: block b (anchored at position a_b) sees the context
positions < a_b and its own rows, through an explicit boolean mask.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mtp_head import RMSNorm, apply_rope, rope_cos_sin


@dataclass
class DrafterConfig:
    hidden: int = 576
    layers: int = 1
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn: int = 1536
    eps: float = 1e-5
    rope_theta: float = 100000.0
    vocab: int = 49152
    target_layers: list = field(default_factory=lambda: [1, 8, 15, 22, 28])
    block: int = 8
    mask_token: int = 0

    def hf_config(self):
        """The drafter's config.json (the layout of published DFlash drafters)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab,
            "dflash_config": {
                "target_layer_ids": list(self.target_layers),
                "block_size": self.block,
                "mask_token_id": self.mask_token,
            },
        }


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h, qd, kvd = c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.input_layernorm = RMSNorm(h, c.eps)
        self.q_proj = nn.Linear(h, qd, bias=False)
        self.k_proj = nn.Linear(h, kvd, bias=False)
        self.v_proj = nn.Linear(h, kvd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.eps)
        self.k_norm = RMSNorm(c.head_dim, c.eps)
        self.post_attention_layernorm = RMSNorm(h, c.eps)
        self.gate_proj = nn.Linear(h, c.ffn, bias=False)
        self.up_proj = nn.Linear(h, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, h, bias=False)

    def forward(self, x, ctx, q_pos, kv_pos, mask):
        """x [B, Q, h] block rows; ctx [B, C, h] fused context; q_pos [B, Q]; kv_pos [B, C + Q];
        mask [B, Q, C + Q] (True: visible)."""
        c = self.c
        B, Q, _ = x.shape
        xn = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(xn).view(B, Q, c.n_heads, c.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, xn], dim=1)
        K = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(B, K, c.n_kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, K, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cq, sq = rope_cos_sin(q_pos, c.head_dim, c.rope_theta)
        ck, sk = rope_cos_sin(kv_pos, c.head_dim, c.rope_theta)
        q = apply_rope(q, cq[:, None], sq[:, None])
        k = apply_rope(k, ck[:, None], sk[:, None])
        rep = c.n_heads // c.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, Q, -1))
        xn = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(xn)) * self.up_proj(xn))


class BlockDrafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layers) * c.hidden, c.hidden, bias=False)
        self.hidden_norm = RMSNorm(c.hidden, c.eps)
        self.layers = nn.ModuleList([DrafterLayer(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden, c.eps)

    def fuse(self, states):
        return self.hidden_norm(self.fc(states))

    def forward_blocks(self, states, embed, block_tokens, anchors, ctx_valid):
        """Teacher-forced blocks. states [B, T, n·h] target states of positions 0..T-1; embed: the target's
        embedding table; block_tokens [B, M, block] ([t_a, mask, ...] per block); anchors [B, M] (block b sits at
        positions a_b..a_b+block-1 and sees context positions < a_b); ctx_valid [B, T] real (not padding)
        positions. Returns the final hidden states of every block row, [B, M, block, h]."""
        c = self.c
        B, T, _ = states.shape
        M, Bk = block_tokens.shape[1], block_tokens.shape[2]
        ctx = self.fuse(states)
        x = F.embedding(block_tokens.reshape(B, M * Bk), embed)
        offs = torch.arange(Bk, device=states.device)
        q_pos = (anchors[:, :, None] + offs).reshape(B, M * Bk)
        ctx_pos = torch.arange(T, device=states.device).expand(B, T)
        kv_pos = torch.cat([ctx_pos, q_pos], dim=1)
        # Block b's rows see context positions < a_b and every row of block b.
        see_ctx = (ctx_pos[:, None, :] < anchors.repeat_interleave(Bk, dim=1)[:, :, None]) & ctx_valid[:, None, :]
        blk = torch.arange(M, device=states.device).repeat_interleave(Bk)
        see_blk = (blk[:, None] == blk[None, :]).expand(B, M * Bk, M * Bk)
        mask = torch.cat([see_ctx, see_blk], dim=2)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, mask)
        return self.norm(x).view(B, M, Bk, c.hidden)

    def state_dict_hf(self):
        """The tensors under the names verity's runtime (and DFlash) reads."""
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm.weight,
               "norm.weight": self.norm.weight}
        for i, l in enumerate(self.layers):
            p = f"layers.{i}."
            out[p + "input_layernorm.weight"] = l.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = l.post_attention_layernorm.weight
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = getattr(l, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{n}.weight"] = getattr(l, n).weight
        return {k: v.detach().float().contiguous().cpu() for k, v in out.items()}

    def load_state_dict_hf(self, tensors):
        """Weights under the runtime's names (what `state_dict_hf` writes): continues training an exported drafter."""
        own = self.state_dict_hf()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"drafter weights lack {missing[:3]}")
        for k in own:
            if tensors[k].shape != own[k].shape:
                raise ValueError(f"{k}: shape {tuple(tensors[k].shape)}, expected {tuple(own[k].shape)}")
        with torch.no_grad():
            for i, l in enumerate(self.layers):
                p = f"layers.{i}."
                pairs = [(l.input_layernorm.weight, p + "input_layernorm.weight"),
                         (l.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")]
                pairs += [(getattr(l, n).weight, p + f"self_attn.{n}.weight")
                          for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
                pairs += [(getattr(l, n).weight, p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]
                for w, k in pairs:
                    w.copy_(tensors[k])
            for w, k in ((self.fc.weight, "fc.weight"), (self.hidden_norm.weight, "hidden_norm.weight"),
                         (self.norm.weight, "norm.weight")):
                w.copy_(tensors[k])
