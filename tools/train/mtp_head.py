"""The MTP head (verity-mtp/1 contract) in PyTorch: a teacher-forced unrolled forward for training
and an explicit KV-cache step for inference/reference.

One head step at position p takes (h_prev, token t_p):
    e   = rmsnorm(E[t_p], w_pre_fc_norm_embedding)
    hh  = rmsnorm(h_prev, w_pre_fc_norm_hidden)
    x   = fc(concat([e, hh]))                   # embedding first, then hidden; no bias
    x   = llama_block(x, position=p, kv=head's own KV cache)
    out = rmsnorm(x, w_norm)
    logits = E @ out                            # tied lm_head
At position 0 there is no target hidden h_{-1}: h_prev is the zero vector there (rmsnorm(0) = 0).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class HeadConfig:
    hidden: int = 576
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn: int = 1536
    eps: float = 1e-5
    rope_theta: float = 100000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions, head_dim, theta, dtype=torch.float32):
    """HF half-split convention: cos/sin of shape [..., head_dim] with the frequency table repeated twice."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    f = positions.to(torch.float64)[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x, cos, sin):
    # x [..., T, D] with cos/sin [T, D] (broadcast)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.q_proj = nn.Linear(c.hidden, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden, bias=False)
        self.gate_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def qkv(self, x, positions):
        """x [B,T,H], positions [T] -> q [B,nh,T,hd], k,v [B,nkv,T,hd] (RoPE applied to q,k)."""
        c = self.c
        B, T, _ = x.shape
        n1 = self.input_layernorm(x)
        q = self.q_proj(n1).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(n1).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(n1).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """q [B,nh,Tq,hd], k/v [B,nkv,Tk,hd], mask bool [Tq,Tk] or [B,1,Tq,Tk] (True = may attend)."""
        rep = self.c.n_heads // self.c.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)  # q head i uses kv head i // rep (HF repeat_kv)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.c.head_dim))
        B, _, Tq, _ = o.shape
        return o.transpose(1, 2).reshape(B, Tq, -1)

    def finish(self, x, attn):
        x = x + self.o_proj(attn)
        n2 = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(n2)) * self.up_proj(n2))

    def forward_causal(self, x, positions=None):
        """Plain causal self-attention layer (used to check this block against the target's own layers)."""
        T = x.shape[1]
        if positions is None:
            positions = torch.arange(T, device=x.device)
        q, k, v = self.qkv(x, positions)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return self.finish(x, self.attend(q, k, v, mask))


def unrolled_mask(T, d, device):
    """Boolean mask [T, d*T] for depth d (1-based) over keys [K_1 | K_2 | ... | K_d] (each T long).

    The depth-d query at position j sees committed slots (depth-1 keys) at positions i <= j-d+1,
    and for k = 2..d exactly the depth-k slot at position j-d+k.
    """
    j = torch.arange(T, device=device)[:, None]
    i = torch.arange(T, device=device)[None, :]
    blocks = [i <= j - d + 1]
    for k in range(2, d + 1):
        blocks.append(i == j - d + k)
    return torch.cat(blocks, dim=1)


class MTPHead(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.pre_fc_norm_embedding = RMSNorm(c.hidden, c.eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hidden, c.eps)
        self.fc = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.block = LlamaBlock(c)
        self.norm = RMSNorm(c.hidden, c.eps)

    def fuse(self, emb, h_prev):
        """emb = E[t] rows, h_prev the previous hidden (target's, or the head's own out)."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(h_prev)], dim=-1))

    def forward_unrolled(self, E, h, tokens, depth, mask_fn=unrolled_mask):
        """Teacher-forced unrolled training forward.

        E [V,H] embedding (frozen), h [B,T,H] target post-norm hidden, tokens [B,T].
        Returns outs: list over depth d=1..D of [B,T,H]; outs[d-1][:, j] is the depth-d output at position j,
        i.e. the head's prediction (via E) of token j+1 when the chain started at p = j-d+1 with h_{p-1}.
        Valid for j >= d-1 (the chain's start p >= 0).
        """
        B, T, H = h.shape
        pos = torch.arange(T, device=h.device)
        emb = F.embedding(tokens, E)
        zero = torch.zeros(B, 1, H, device=h.device, dtype=h.dtype)
        Ks, Vs, outs = [], [], []
        prev = h
        for d in range(1, depth + 1):
            h_prev = torch.cat([zero, prev[:, :-1]], dim=1).to(h.dtype)  # input at j is the previous level's output at j-1
            x = self.fuse(emb, h_prev)
            q, k, v = self.block.qkv(x, pos)
            Ks.append(k)
            Vs.append(v)
            mask = mask_fn(T, d, h.device)
            a = self.block.attend(q, torch.cat(Ks, dim=2), torch.cat(Vs, dim=2), mask)
            out = self.norm(self.block.finish(x, a))
            outs.append(out)
            prev = out
        return outs

    # ---- explicit step-by-step inference (reference) --------------------------------------------
    def step(self, E, h_prev, tok, pos):
        """First half of one head step at position `pos` for a single sequence (h_prev [H], tok int):
        returns (x, q, (k, v)) where (k, v) [nkv,hd] is this step's KV slot for position `pos`."""
        x = self.fuse(E[tok][None, None], h_prev[None, None])
        q, k, v = self.block.qkv(x, torch.tensor([pos], device=x.device))
        return x, q, (k[0, :, 0], v[0, :, 0])

    def step_finish(self, x, q, ks, vs):
        """Second half: attend the listed KV slots (no mask: the caller lists exactly the visible slots)."""
        K = torch.stack(ks, dim=1)[None]  # [1,nkv,n,hd]
        V = torch.stack(vs, dim=1)[None]
        a = self.block.attend(q, K, V, None)
        out = self.norm(self.block.finish(x, a))[0, 0]
        return out


def reference_chain_outputs(head, E, h, tokens, depth):
    """Slow reference of the inference procedure for one sequence (h [T,H], tokens [T]).

    For every chain start p (0..T-1): committed KV slots 0..p are computed from (h_{q-1}, t_q) with
    h_{-1} = 0; step 1 at p attends them; step d (2..depth) at position p+d-1 takes the previous step's
    out and the token t_{p+d-1} (teacher forcing: the drafted tokens are the data tokens), writes its own
    speculative slot and attends committed slots 0..p plus the speculative slots of this chain.
    Returns dict (d, j) -> out [H] for depth d at position j = p+d-1.
    """
    T = tokens.shape[0]
    H = h.shape[1]
    zero = torch.zeros(H, dtype=h.dtype, device=h.device)
    # committed slots: the K/V of a slot depends only on its input, so compute each once.
    committed = []
    for qpos in range(T):
        hp = zero if qpos == 0 else h[qpos - 1]
        _, _, kv = head.step(E, hp, int(tokens[qpos]), qpos)
        committed.append(kv)
    res = {}
    for p in range(T):
        # step 1 at position p
        hp = zero if p == 0 else h[p - 1]
        x, q, _ = head.step(E, hp, int(tokens[p]), p)
        ks = [committed[i][0] for i in range(p + 1)]
        vs = [committed[i][1] for i in range(p + 1)]
        out = head.step_finish(x, q, ks, vs)
        res[(1, p)] = out
        spec_k, spec_v = [], []
        for d in range(2, depth + 1):
            j = p + d - 1
            if j >= T:
                break
            x, q, (k, v) = head.step(E, out, int(tokens[j]), j)
            spec_k.append(k)
            spec_v.append(v)
            out = head.step_finish(x, q, ks + spec_k, vs + spec_v)
            res[(d, j)] = out
    return res
