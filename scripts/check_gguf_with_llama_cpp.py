"""Check `verity quantize`'s safetensors conversion against llama.cpp: each fixture bundle is converted to a GGUF
(`--type f32`), llama.cpp (llama-cpp-python) loads it and evaluates the bundle's reference tokens, and its logits
are compared with transformers' (the bundle's committed `logits.f32`).

    python3 scripts/check_gguf_with_llama_cpp.py [--verity target/release/verity] [BUNDLE ...]

Needs llama-cpp-python (any build) and numpy; exits 1 if a file does not load or its logits differ by more than
1 % of the largest or pick another argmax anywhere.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

FIXTURES = os.path.join(os.path.dirname(__file__), "../crates/verity/tests/fixtures/hf")
BUNDLES = ["llama-f32", "llama-bf16", "llama-f16-tied", "llama-rope-llama3", "qwen2-f32", "qwen3-f32",
           "qwen3-bf16"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--verity", default="target/release/verity")
    ap.add_argument("bundles", nargs="*", default=BUNDLES)
    args = ap.parse_args()
    from llama_cpp import Llama

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.bundles:
            src, out = os.path.join(FIXTURES, name), os.path.join(tmp, name + ".gguf")
            subprocess.run([args.verity, "quantize", src, out, "--type", "f32"], check=True,
                           stdout=subprocess.DEVNULL)
            ref = json.load(open(os.path.join(src, "reference.json")))
            tokens = ref["token_ids"]
            want = np.fromfile(os.path.join(src, "logits.f32"), dtype=np.float32).reshape(len(tokens), -1)
            try:
                llm = Llama(model_path=out, n_ctx=max(256, len(tokens)), logits_all=True, verbose=False,
                            n_threads=2)
            except ValueError as e:
                print(f"{name}: llama.cpp does not load it: {e}")
                failed = True
                continue
            llm.eval(tokens)
            got = np.array(llm.scores[:len(tokens)], dtype=np.float32)
            worst, scale = float(np.abs(want - got).max()), float(np.abs(want).max())
            same = bool((want.argmax(1) == got.argmax(1)).all())
            ok = worst <= 0.01 * scale and same
            failed |= not ok
            print(f"{name}: max |llama.cpp - transformers| {worst:.2e} (largest {scale:.2f}), "
                  f"argmax {'equal' if same else 'DIFFERS'} at all {len(tokens)} positions: {'ok' if ok else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
