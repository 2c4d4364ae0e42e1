"""The training-side drafter (dflash_drafter.py) against the reference verity's runtime is tested on
(crates/verity/tests/fixtures/drafter: a float64 numpy forward of the same definition): the committed drafter,
the tiny target's embedding and output matrices, the reference's context states and block. Also checks that
blocks trained together see only their own context: the same block alone, or beside other blocks, gives the
same rows. Exit status 1 on failure.

    python3 tools/train/test_dflash_drafter.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_drafter import BlockDrafter, DrafterConfig  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../crates/verity/tests/fixtures")


def main():
    from safetensors.torch import load_file
    cfg_json = json.load(open(os.path.join(ROOT, "drafter/config.json")))
    d = cfg_json["dflash_config"]
    cfg = DrafterConfig(hidden=cfg_json["hidden_size"], layers=cfg_json["num_hidden_layers"],
                        n_heads=cfg_json["num_attention_heads"], n_kv_heads=cfg_json["num_key_value_heads"],
                        head_dim=cfg_json["head_dim"], ffn=cfg_json["intermediate_size"],
                        eps=cfg_json["rms_norm_eps"], rope_theta=cfg_json["rope_theta"], vocab=cfg_json["vocab_size"],
                        target_layers=d["target_layer_ids"], block=d["block_size"], mask_token=d["mask_token_id"])
    drafter = BlockDrafter(cfg).double()
    weights = load_file(os.path.join(ROOT, "drafter/model.safetensors"))
    own = drafter.state_dict_hf()
    assert set(own) == set(weights), set(own) ^ set(weights)
    # state_dict_hf names -> module parameters
    params = dict(drafter.named_parameters())
    rename = {}
    for name in own:
        mod = name.replace("self_attn.", "").replace("mlp.", "")
        rename[name] = mod
    with torch.no_grad():
        for name, t in weights.items():
            params[rename[name]].copy_(t.double())
    target = load_file(os.path.join(ROOT, "hf/llama-f32/model.safetensors"))
    E, lm_head = target["model.embed_tokens.weight"].double(), target["lm_head.weight"].double()
    ref = json.load(open(os.path.join(ROOT, "drafter/reference.json")))
    ctx = ref["context_len"]
    states = torch.tensor(ref["context_states"], dtype=torch.float64).view(1, ctx, -1)
    blocks = torch.tensor([[[ref["pending"]] + [cfg.mask_token] * (cfg.block - 1)]])
    anchors = torch.tensor([[ctx]])
    # The states of the block's own positions are padding (never visible to the block).
    padded = torch.cat([states, torch.randn(1, cfg.block, states.shape[-1], dtype=torch.float64)], dim=1)
    valid = torch.ones(1, padded.shape[1], dtype=torch.bool)
    hid = drafter.forward_blocks(padded, E, blocks, anchors, valid)[0, 0, 1:]
    logits = hid @ lm_head.T
    want = torch.tensor(ref["logits"], dtype=torch.float64)
    err = (logits - want).abs().max().item()
    print(f"max |logits - reference| = {err:.2e}")
    # RMSNorm and RoPE tables compute in f32 (as in training): agreement to f32 precision.
    ok = err < 1e-5

    # Two blocks at once: the first (anchored earlier) must equal itself alone.
    a2 = torch.tensor([[5, ctx]])
    b2 = torch.cat([torch.tensor([[[7] + [cfg.mask_token] * (cfg.block - 1)]]), blocks], dim=1)
    both = drafter.forward_blocks(padded, E, b2, a2, valid)[0]
    alone = drafter.forward_blocks(padded, E, b2[:, :1], a2[:, :1], valid)[0, 0]
    err2 = max((both[0] - alone).abs().max().item(), (both[1, 1:] - hid).abs().max().item())
    print(f"blocks together vs alone: max |diff| = {err2:.2e}")
    ok &= err2 < 1e-9
    if not ok:
        print("FAILED")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
