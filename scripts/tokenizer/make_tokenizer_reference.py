#!/usr/bin/env python3
"""Make the tokenizer reference fixture for verity's tokenizer tests.

The independent implementation is llama.cpp's own tokenizer (llama-cpp-python, vocab_only=True).
For every string of CORPUS below it records:
  text         the input string
  ids          llm.tokenize(text.encode(), add_bos=False, special=False)  (special tokens are plain text)
  ids_special  llm.tokenize(text.encode(), add_bos=False, special=True)   (special tokens are parsed)
  decoded      llm.detokenize(ids).decode('utf-8', errors='replace')
  decoded_special  llm.detokenize(ids_special, special=True) likewise (special tokens rendered)

Cross-check (gpt2-model vocabularies): if `tokenizers` (Hugging Face) is installed, a byte-level BPE is
rebuilt from the GGUF's own vocab/merges with SmolLM2's pre-tokenizer (individual digits, then the GPT-2 regex)
and every string is tokenized again; disagreements with llama.cpp are reported (and stored under
"cross_check"), never fatal.

Usage:
  python scripts/tokenizer/make_tokenizer_reference.py \
      --model /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out crates/verity/tests/fixtures/tokenizer/smollm2_llamacpp.json
  python scripts/tokenizer/make_tokenizer_reference.py \
      --model ~/.cache/verity/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf \
      --out crates/verity/tests/fixtures/tokenizer/gemma3_270m_llamacpp.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys

CORPUS: list[tuple[str, str]] = [
    # --- English prose
    ("prose_simple", "Hello world"),
    ("prose_leading_space", " Hello world"),
    ("prose_sentence", "The quick brown fox jumps over the lazy dog."),
    ("prose_paragraph",
     "Bees collect nectar from flowers, store it in their honey stomach, and bring it back to the hive. "
     "There, worker bees pass it mouth to mouth, adding enzymes, until it becomes honey!"),
    ("prose_punct", "Wait... what?! \"Quoted\" (parenthesised) [bracketed] {braced} -- em\u2014dash; semi: colon."),
    ("prose_caps", "HELLO WORLD, this Is MiXeD CaSe."),
    # --- contractions
    ("contractions", "don't won't can't it's I'm you're we've they'd she'll"),
    ("contractions_upper", "I'LL DON'T WE'RE IT'S THEY'VE"),
    ("contractions_curly", "don\u2019t it\u2019s"),
    # --- unicode
    ("accents", "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe se\u00f1or \u00e5ngstr\u00f6m"),
    ("combining_marks", "Cafe\u0301 n\u0303 a\u0308 e\u0301\u0301 Z\u0351\u0300\u0317a\u0308lgo"),
    ("cjk_chinese", "\u6211\u7231\u81ea\u7136\u8bed\u8a00\u5904\u7406\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff01"),
    ("cjk_japanese", "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u6f22\u5b57\u3002"),
    ("korean", "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4"),
    ("arabic", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f"),
    ("cyrillic_greek", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u03ba\u03cc\u03c3\u03bc\u03b5"),
    ("devanagari", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e"),
    ("nbsp_and_zero_width", "a\u00a0b\u2009c\u200bd\ufeffe"),
    # --- emoji
    ("emoji_simple", "I love pizza \U0001F355 and cats \U0001F431!"),
    ("emoji_zwj_family", "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 family"),
    ("emoji_skin_tone", "\U0001F44D\U0001F3FD thumbs \U0001F44B\U0001F3FF"),
    ("emoji_flags", "\U0001F1EB\U0001F1F7 \U0001F1EF\U0001F1F5 \U0001F1FA\U0001F1F8 \U0001F3F4\u200D\u2620\uFE0F"),
    ("emoji_only", "\U0001F600\U0001F601\U0001F602\U0001F923\u2764\uFE0F"),
    # --- code
    ("code_python",
     "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
    ("code_rust",
     "fn main() {\n    let v: Vec<u32> = (1..=10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n"),
    ("code_json",
     "{\n  \"name\": \"verity\",\n  \"version\": \"0.1.0\",\n  \"tags\": [\"llm\", \"rust\"],\n"
     "  \"nested\": {\n    \"ok\": true,\n    \"n\": null\n  }\n}"),
    ("code_tabs_makefile", "all:\n\tcargo build --release\n\t@echo done\n"),
    ("code_operators", "a != b && c <= d || e >= f; x += 1; y -= 2; z **= 3; p->q; r::s; t => u; // comment"),
    ("code_html", "<div class=\"x\"><a href='https://example.com/?q=1&r=2'>link</a></div>"),
    # --- whitespace runs
    ("ws_multi_spaces", "a  b   c    d     e"),
    ("ws_tabs", "a\tb\t\tc\t\t\td"),
    ("ws_newlines", "line1\n\n\nline2\n\nline3\n"),
    ("ws_trailing_spaces", "trailing spaces   "),
    ("ws_leading_spaces", "     leading"),
    ("ws_only", "   \t\n  \n\n "),
    ("ws_crlf", "windows\r\nline\r\n\r\nend"),
    # --- digits
    ("digits_long", "1234567890"),
    ("digits_decimals", "3.14159 2.71828 -0.5 1e-10 6.022e23"),
    ("digits_mixed", "There are 365 days, 24 hours, and 1,000,000 ways in 2024 (v1.2.3 / 10%)."),
    ("digits_phone_date", "Call +1 (555) 123-4567 on 2025-01-31 at 09:45."),
    # --- special tokens
    ("special_chatml", "<|im_start|>user\nhi<|im_end|>"),
    ("special_chatml_full",
     "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    ("special_endoftext", "end<|endoftext|>start"),
    ("special_lookalike", "<|im_start |> <im_start> <|not_a_token|>"),
    # --- edge cases
    ("single_char", "a"),
    ("single_space", " "),
    ("empty", ""),
]


# --------------------------------------------------------------------------------------------------
# Minimal GGUF metadata reader (only what the cross-check needs).
# --------------------------------------------------------------------------------------------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: str) -> dict:
    with open(path, "rb") as f:
        def rd(fmt):
            n = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(n))[0]

        def rstr():
            return f.read(rd("<Q")).decode("utf-8", errors="surrogateescape")

        def rval(t):
            if t == 8:
                return rstr()
            if t == 9:
                et, n = rd("<I"), rd("<Q")
                return [rval(et) for _ in range(n)]
            return rd(_SCALAR[t])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        rd("<I")  # version
        rd("<Q")  # tensor count
        n_kv = rd("<Q")
        meta = {}
        for _ in range(n_kv):
            key = rstr()
            meta[key] = rval(rd("<I"))
        return meta


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_hf_tokenizers(meta: dict):
    """Byte-level BPE from the GGUF vocab/merges with SmolLM2's pre-tokenizer; (plain, with_specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}

    def make(with_specials: bool):
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        if with_specials:
            specials = [t for t, ty in zip(tokens, types) if ty in (3, 4)]  # CONTROL, USER_DEFINED
            tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return tk

    return make(False), make(True)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=os.path.join(repo, "crates/verity/tests/fixtures/tokenizer/smollm2_llamacpp.json"))
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, vocab_only=True, verbose=False)
    meta = read_gguf_metadata(args.model)

    cases = []
    for name, text in CORPUS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        ids_special = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({
            "name": name,
            "text": text,
            "ids": list(ids),
            "ids_special": list(ids_special),
            "decoded": llm.detokenize(ids).decode("utf-8", errors="replace"),
            "decoded_special": llm.detokenize(ids_special, special=True).decode("utf-8", errors="replace"),
        })

    # --- cross-check with Hugging Face `tokenizers`, if present
    cross = {"tool": None, "disagreements": []}
    try:
        import tokenizers

        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ImportError("the cross-check rebuilds gpt2-model vocabularies only")
        plain, special = build_hf_tokenizers(meta)
        cross["tool"] = f"tokenizers {tokenizers.__version__} (BPE rebuilt from the GGUF vocab/merges)"
        for c in cases:
            for field, tk in (("ids", plain), ("ids_special", special)):
                hf = tk.encode(c["text"], add_special_tokens=False).ids
                if hf != c[field]:
                    cross["disagreements"].append({"name": c["name"], "field": field, "llama_cpp": c[field],
                                                   "tokenizers": hf})
    except ImportError as e:
        cross["tool"] = f"not run ({e})"

    out = {
        "description": f"{os.path.basename(args.model)} tokenizer reference made with llama.cpp's tokenizer "
                       "(llama-cpp-python, vocab_only). ids: special=False (special tokens as text); "
                       "ids_special: special=True; add_bos=False for both.",
        "generator": "scripts/tokenizer/make_tokenizer_reference.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "gguf_file": os.path.basename(args.model),
        "gguf_sha256": sha256_file(args.model),
        "tokenizer_model": meta.get("tokenizer.ggml.model"),
        "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
        "n_vocab": llm.n_vocab(),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
        "cross_check": cross,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # Pretty at the top level, one line per case (easy to diff, still plain JSON).
    head = {k: v for k, v in out.items() if k != "cases"}
    text = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    text += ',\n "cases": [\n' + ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases) + "\n ]\n}\n"
    json.loads(text)  # sanity
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)

    print(f"wrote {len(cases)} cases to {args.out}")
    print(f"llama-cpp-python {llama_cpp.__version__}, gguf sha256 {out['gguf_sha256']}")
    print(f"cross-check: {cross['tool']}; {len(cross['disagreements'])} disagreement(s)")
    for d in cross["disagreements"]:
        print(f"  {d['name']} [{d['field']}]\n    llama.cpp  {d['llama_cpp']}\n    tokenizers {d['tokenizers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
