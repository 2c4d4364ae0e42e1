"""Test: the unrolled, masked training forward of the MTP head equals a slow step-by-step
reference of the inference procedure (explicit KV-cache loop), on a tiny random model.

Also checks that the test can fail: deliberately wrong masks must NOT match the reference.
Run: python3 tools/train/test_unrolled_attention.py   (exit status 0 = pass, 1 = fail)
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mtp_head import HeadConfig, MTPHead, reference_chain_outputs, unrolled_mask  # noqa: E402


def make_head(seed):
    torch.manual_seed(seed)
    c = HeadConfig(hidden=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn=48, eps=1e-5, rope_theta=10000.0)
    head = MTPHead(c).double()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # norms away from 1 so norm mix-ups show
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return head, c


def max_err(head, E, h, tokens, D, mask_fn=unrolled_mask):
    B, T = tokens.shape
    with torch.no_grad():
        outs = head.forward_unrolled(E, h, tokens, D, mask_fn=mask_fn)
        worst, n = 0.0, 0
        for b in range(B):
            ref = reference_chain_outputs(head, E, h[b], tokens[b], D)
            for (d, j), o in ref.items():
                worst = max(worst, (outs[d - 1][b, j] - o).abs().max().item())
                n += 1
    return worst, n


def wrong_mask_all_committed(T, d, device):
    # bug: depth-d query sees every committed slot <= j (leaks the future committed slots)
    m = unrolled_mask(T, d, device)
    j = torch.arange(T, device=device)[:, None]
    i = torch.arange(T, device=device)[None, :]
    m[:, :T] = i <= j
    return m


def wrong_mask_spec_shift(T, d, device):
    # bug: the depth-k speculative slot is taken one position too early
    j = torch.arange(T, device=device)[:, None]
    i = torch.arange(T, device=device)[None, :]
    blocks = [i <= j - d + 1]
    for k in range(2, d + 1):
        blocks.append(i == j - d + k - (1 if k < d else 0))
    return torch.cat(blocks, dim=1)


def wrong_mask_no_spec(T, d, device):
    # bug: only committed slots + own slot (ignores the intermediate speculative slots)
    m = unrolled_mask(T, d, device)
    m[:, T:(d - 1) * T] = False
    return m


def main():
    ok = True
    for seed, (B, T, D) in [(0, (2, 9, 4)), (1, (1, 12, 3)), (2, (3, 7, 4))]:
        head, c = make_head(seed)
        V = 40
        E = torch.randn(V, c.hidden, dtype=torch.float64)
        h = torch.randn(B, T, c.hidden, dtype=torch.float64) * 2.0
        tokens = torch.randint(0, V, (B, T))
        err, n = max_err(head, E, h, tokens, D)
        good = err < 1e-9
        ok &= good
        print(f"seed {seed} B={B} T={T} D={D}: unrolled vs reference max|diff| = {err:.3e} over {n} (depth, position) outputs -> {'OK' if good else 'FAIL'}")
        for name, fn in [("all-committed", wrong_mask_all_committed), ("spec-shift", wrong_mask_spec_shift), ("no-spec", wrong_mask_no_spec)]:
            werr, _ = max_err(head, E, h, tokens, D, mask_fn=fn)
            detected = werr > 1e-6
            ok &= detected
            print(f"    mutated mask '{name}': max|diff| = {werr:.3e} -> {'detected (good)' if detected else 'NOT DETECTED (test too weak)'}")
    # the mask itself for a small case, for eyeballing
    print("mask depth 3, T=5 (rows: query j; cols: K1|K2|K3):")
    for row in unrolled_mask(5, 3, "cpu").int().tolist():
        print("   ", "".join(map(str, row[:5])), "".join(map(str, row[5:10])), "".join(map(str, row[10:])))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
