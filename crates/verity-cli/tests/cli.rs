//! The `verity` binary end to end: real processes, real files, exit codes and messages.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn verity(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_verity"))
        .args(args)
        .output()
        .expect("running verity")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../verity/tests/fixtures/hf")
        .join(name)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_streams_an_answer_and_reports_speed() {
    let b = fixture("llama-f32");
    let out = verity(&[
        "--threads",
        "2",
        "run",
        "--model",
        b.to_str().unwrap(),
        "--max-tokens",
        "6",
        "hello",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("tok/s"), "{}", text(&out.stderr));
}

/// `--device auto` (the default) took the CPU above; asking for CUDA from a build without it is an error that
/// says how to get it, never a silent CPU run.
#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_without_the_cuda_build_says_how_to_build_it() {
    let b = fixture("llama-f32");
    let model = b.to_str().unwrap();
    let out = verity(&["--device", "cuda", "run", "--model", model, "hello"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--features cuda"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn chat_keeps_the_conversation_and_reuses_its_cache() {
    use std::io::Write;
    let b = fixture("llama-f32");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_verity"))
        .args([
            "--threads",
            "2",
            "chat",
            "--model",
            b.to_str().unwrap(),
            "--max-tokens",
            "5",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(b"hello there\nand again\n\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("route ")).collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(turns[0].contains("(0 restored)"), "{}", turns[0]);
    assert!(
        !turns[1].contains("(0 restored)"),
        "the second turn reuses the first turn's cache: {}",
        turns[1]
    );
}

#[test]
fn fetch_is_idempotent_and_inspect_describes_the_default_model() {
    let a = verity(&["fetch"]);
    let b = verity(&["fetch"]);
    assert!(
        a.status.success() && b.status.success(),
        "{}",
        text(&a.stderr)
    );
    assert_eq!(text(&a.stdout), text(&b.stdout));
    let path = text(&a.stdout).trim().to_string();
    assert!(path.ends_with(".gguf") && Path::new(&path).is_file());
    let out = verity(&["inspect", "smollm2-135m"]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for needle in [
        "architecture  llama",
        "30 layers",
        "Q4_1",
        "<|im_end|>",
        "chat template",
    ] {
        assert!(s.contains(needle), "inspect output lacks {needle:?}:\n{s}");
    }
    assert!(!s.contains("rope scaling"), "{s}");
}

/// `inspect` names a bundle's RoPE scaling (here Llama 3's rule from a safetensors config).
#[test]
fn inspect_names_the_rope_scaling() {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures/hf/llama-rope-llama3");
    let out = verity(&["inspect", dir.to_str().unwrap()]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        s.contains(
            "rope scaling  Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0"
        ),
        "{s}"
    );
}

/// A base model (Gemma 3 270M, no chat template): `inspect` describes its local and global layers, and `run`
/// continues the prompt as raw text and says so.
#[test]
fn a_base_model_continues_raw_text_and_says_so() {
    let out = verity(&["inspect", "gemma3-270m"]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for needle in [
        "architecture  gemma3",
        "15 local layers (window 512, rope theta 10000), 3 global",
        "GeluTanh MLP; post-norms",
        "chat template none",
    ] {
        assert!(s.contains(needle), "inspect output lacks {needle:?}:\n{s}");
    }
    let out = verity(&[
        "--threads",
        "2",
        "run",
        "--model",
        "gemma3-270m",
        "--max-tokens",
        "8",
        "The capital of France is",
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("no chat template"), "{err}");
    assert!(!text(&out.stdout).trim().is_empty(), "no text continued");
}

#[test]
fn bad_input_exits_nonzero_with_the_file_and_problem_named() {
    let dir = std::env::temp_dir().join(format!("verity-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("broken.gguf");
    std::fs::write(&bad, b"GGML not really a model").unwrap();
    for args in [
        vec!["inspect", bad.to_str().unwrap()],
        vec!["run", "--model", bad.to_str().unwrap(), "hi"],
    ] {
        let out = verity(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("broken.gguf") && err.contains("not a GGUF file"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = verity(&["run", "--model", "no-such-model", "hi"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not a known model"));
    let out = verity(&[
        "run",
        "--model",
        fixture("llama-f32").to_str().unwrap(),
        "--top-p",
        "0",
        "hi",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("top_p"));
}

#[test]
fn bench_speed_writes_the_documented_records_and_its_plot() {
    let dir = std::env::temp_dir().join(format!("verity-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            r#"{"id":"p1","category":"prose","messages":[{"role":"user","content":"Say something."}]}"#,
            "\n",
            r#"{"id":"c1","category":"conversation","turns":[{"role":"user","content":"Hi."},{"role":"user","content":"More."}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let json = dir.join("out.json");
    let b = fixture("llama-f32");
    let out = verity(&[
        "bench",
        "speed",
        "--model",
        b.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--repeat",
        "2",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        dir.join("plots").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (w, h) = png_size(&dir.join("plots/speed.png"));
    assert!(w > 0 && h > 0, "{w}×{h}");
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        2 * (1 + 2),
        "repeats × (1 single-turn + 2 conversation turns)"
    );
    for r in &records {
        for key in [
            "prompt_id",
            "category",
            "turn",
            "route",
            "repeat",
            "prompt_tokens",
            "restored_tokens",
            "completion_tokens",
            "ttft_s",
            "decode_tok_s",
            "cycles",
            "accepted_per_cycle",
            "verify_rows",
            "draft_s",
            "verify_s",
            "other_s",
            "text",
        ] {
            assert!(r.get(key).is_some(), "record lacks {key}: {r}");
        }
    }
    let turn2 = records.iter().find(|r| r["turn"] == 2).unwrap();
    assert!(
        turn2["restored_tokens"].as_u64().unwrap() > 0,
        "turn 2 reuses turn 1's cache"
    );
    assert!(text(&out.stdout).contains("route"), "summary table printed");
}

#[test]
fn inspect_names_mlx_quantization_per_tensor_kind() {
    let out = verity(&["inspect", fixture("mlx-llama-q8-g128").to_str().unwrap()]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(s.contains("mlx-safetensors"), "{s}");
    assert!(
        s.contains("self_attn.q_proj.weight mlx-affine-q8-g128 ×2"),
        "{s}"
    );
    assert!(
        !s.contains(".scales"),
        "scales are part of the quantized weight: {s}"
    );
}

#[test]
fn inspect_describes_a_mixture_of_experts_from_either_format() {
    for (name, sparse) in [("qwen3-moe-f16", 2), ("qwen3-moe-gguf", 3)] {
        let out = verity(&["inspect", fixture(name).to_str().unwrap()]);
        let s = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let line = format!(
            "experts       2 of 8 per token, 32 units each (weights renormalized), in {sparse} of 3 layers"
        );
        assert!(s.contains(&line), "{name}: {s}");
    }
}

#[test]
fn inspect_describes_a_linear_attention_hybrid_from_either_format() {
    for (name, sparse) in [("qwen3-next-f16", 3), ("qwen3-next-gguf", 4)] {
        let out = verity(&["inspect", fixture(name).to_str().unwrap()]);
        let s = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let experts = format!(
            "experts       2 of 4 per token, 32 units each (weights renormalized), in {sparse} of 4 layers"
        );
        for line in [
            "architecture  qwen3next",
            "RoPE on 4 of 16 values per head; gated attention output",
            &experts,
            "and a gated shared expert of 64 units for every token",
            "linear attn   Gated DeltaNet in 2 of 4 layers (2 key heads × 16, 4 value heads × 16, convolution of \
             4; a state of 5.6 kB per layer), full attention in the others",
        ] {
            assert!(s.contains(line), "{name}: {line:?} in {s}");
        }
    }
}

/// The width and height in a PNG's IHDR chunk (the first chunk, right after the signature).
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn bench_plot_redraws_saved_records_as_png() {
    let dir = std::env::temp_dir().join(format!("verity-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let record = |route: &str, category: &str, tok_s: f64| {
        serde_json::json!({
            "prompt_id": format!("{category}-1"), "category": category, "turn": 1, "route": route,
            "repeat": 0, "prompt_tokens": 20, "restored_tokens": 0, "completion_tokens": 64,
            "ttft_s": 0.01, "decode_tok_s": tok_s, "cycles": 64, "accepted_per_cycle": 1.0,
            "draft_s": 0.0, "verify_s": 0.3, "other_s": 0.0, "text": "…"
        })
    };
    let speed = dir.join("speed-records.json");
    let records = serde_json::json!([
        record("ar", "prose", 100.0),
        record("mtp", "prose", 130.0),
        record("ar", "code", 90.0),
        record("mtp", "code", 150.0),
    ]);
    std::fs::write(&speed, records.to_string()).unwrap();
    // Runs merged under keys, as bench/results/rowcost/ keeps them.
    let rowcost = dir.join("rowcost-runs.json");
    let run = |ms: [f64; 3]| {
        let widths: Vec<_> = [1, 4, 16]
            .into_iter()
            .zip(ms)
            .map(|(w, m)| serde_json::json!({"w": w, "median_ms": m, "ratio_to_w1": m / ms[0]}))
            .collect();
        serde_json::json!({"widths": widths, "floor": null})
    };
    let runs = serde_json::json!({"run1": run([5.0, 7.0, 15.0]), "run2": run([6.0, 7.5, 16.0])});
    std::fs::write(&rowcost, runs.to_string()).unwrap();
    let plots = dir.join("plots/nested");
    for (json, name) in [(&speed, None), (&rowcost, Some("rowcost-cpu"))] {
        let mut args = vec![
            "bench",
            "plot",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            plots.to_str().unwrap(),
        ];
        args.extend(name.iter().flat_map(|n| ["--name", n]));
        let out = verity(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let png = plots.join(format!("{}.png", name.unwrap_or("speed")));
        assert_eq!(text(&out.stdout).trim(), png.to_str().unwrap());
        let (w, h) = png_size(&png);
        assert!(w > 0 && h > 0, "{w}×{h}");
    }
}

#[test]
fn bench_plot_into_an_unusable_folder_names_the_folder() {
    let dir = std::env::temp_dir().join(format!("verity-plot-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("rowcost.json");
    std::fs::write(
        &json,
        r#"{"widths": [{"w": 1, "median_ms": 5.0, "ratio_to_w1": 1.0}], "floor": null}"#,
    )
    .unwrap();
    // Below a regular file: no folder can be made there, not even by root (which ignores permissions).
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, b"").unwrap();
    let plots = blocker.join("plots");
    let out = verity(&[
        "bench",
        "plot",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot create the plot folder") && err.contains(plots.to_str().unwrap()),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A Llama-shaped F16 GGUF with SmolLM2's tokenizer and small random layers (hidden 256: whole K-quant blocks),
/// written with the library's GGUF writer: the input of a quantization run.
fn small_f16_gguf(path: &Path) {
    use verity::bundle::gguf::GgufFile;
    use verity::bundle::gguf_writer::{GgufWriter, TensorEntry};
    use verity::quant::GgmlType;
    let out = verity(&["fetch", "smollm2-135m"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let src = PathBuf::from(text(&out.stdout).trim());
    let smol = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::new();
    for e in smol
        .entries
        .iter()
        .filter(|e| e.key.starts_with("tokenizer."))
    {
        w.set_raw(&e.key, smol.entry_bytes(e).to_vec());
    }
    w.set_str("general.architecture", "llama");
    let (h, ffn, layers, vocab) = (256usize, 512usize, 2usize, 49152usize);
    for (k, v) in [
        ("llama.block_count", layers),
        ("llama.context_length", 512),
        ("llama.embedding_length", h),
        ("llama.feed_forward_length", ffn),
        ("llama.attention.head_count", 4),
        ("llama.attention.head_count_kv", 2),
        ("llama.rope.dimension_count", 64),
        ("general.file_type", 1),
    ] {
        w.set_u32(k, v as u32);
    }
    w.set_f32("llama.rope.freq_base", 10000.0);
    w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    let mut tensors: Vec<(String, Vec<usize>)> = vec![("token_embd.weight".into(), vec![h, vocab])];
    for l in 0..layers {
        for (name, dims) in [
            ("attn_norm", vec![h]),
            ("attn_q", vec![h, h]),
            ("attn_k", vec![h, 128]),
            ("attn_v", vec![h, 128]),
            ("attn_output", vec![h, h]),
            ("ffn_norm", vec![h]),
            ("ffn_gate", vec![h, ffn]),
            ("ffn_up", vec![h, ffn]),
            ("ffn_down", vec![ffn, h]),
        ] {
            tensors.push((format!("blk.{l}.{name}.weight"), dims));
        }
    }
    tensors.push(("output_norm.weight".into(), vec![h]));
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut data = Vec::new();
    for (name, dims) in &tensors {
        let n: usize = dims.iter().product();
        let bytes: Vec<u8> = if dims.len() == 1 {
            (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect()
        } else {
            (0..n)
                .flat_map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2;
                    half::f16::from_f32(v).to_le_bytes()
                })
                .collect()
        };
        let ty = if dims.len() == 1 {
            GgmlType::F32
        } else {
            GgmlType::F16
        };
        w.add_tensor(TensorEntry {
            name: name.clone(),
            dims: dims.clone(),
            ty,
        })
        .unwrap();
        data.push(bytes);
    }
    let mut file = w.header();
    for d in &data {
        w.write_data(&mut file, d).unwrap();
    }
    std::fs::write(path, file).unwrap();
}

/// A hybrid's GGUF (Qwen3-Next: stacked experts, a shared expert, Gated DeltaNet tensors) quantizes: every
/// matrix, the stacked experts included, in the asked type, the convolution, decay rates and norms kept as they
/// are; the result loads and answers.
#[test]
fn quantize_handles_a_hybrid_with_stacked_experts() {
    let dir =
        std::env::temp_dir().join(format!("verity-cli-quantize-hybrid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = fixture("qwen3-next-gguf").join("model.gguf");
    let q = dir.join("qwen3-next-q8_0.gguf");
    let out = verity(&[
        "--threads",
        "2",
        "quantize",
        input.to_str().unwrap(),
        q.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&verity(&["inspect", q.to_str().unwrap()]).stdout);
    for kind in [
        "blk.ffn_gate_exps.weight             Q8_0 ×4",
        "blk.attn_qkv.weight                  Q8_0 ×2",
        "blk.ssm_conv1d.weight                F32 ×2",
        "blk.ssm_a                            F32 ×2",
    ] {
        assert!(s.contains(kind), "{kind:?} in {s}");
    }
    let out = verity(&[
        "--threads",
        "2",
        "run",
        "--model",
        q.to_str().unwrap(),
        "--max-tokens",
        "8",
        "Hello",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_writes_a_model_that_runs_and_refuses_what_it_cannot_do() {
    let dir = std::env::temp_dir().join(format!("verity-cli-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("small-f16.gguf");
    small_f16_gguf(&input);
    let (i, q) = (input.to_str().unwrap(), dir.join("small-q4_k_m.gguf"));

    let out = verity(&[
        "quantize",
        i,
        q.to_str().unwrap(),
        "--type",
        "q4_k_m",
        "--dry-run",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan = text(&out.stdout);
    assert!(
        plan.contains("blk.1.attn_v.weight") && plan.contains("Q6_K"),
        "{plan}"
    );
    assert!(!q.exists(), "a dry run writes nothing");

    let out = verity(&[
        "--threads",
        "2",
        "quantize",
        i,
        q.to_str().unwrap(),
        "--type",
        "q4_k_m",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("q4_k_m"),
        "{}",
        text(&out.stdout)
    );
    let out = verity(&["inspect", q.to_str().unwrap()]);
    assert!(text(&out.stdout).contains("Q4_K"), "{}", text(&out.stdout));
    let out = verity(&[
        "--threads",
        "2",
        "run",
        "--model",
        q.to_str().unwrap(),
        "--max-tokens",
        "8",
        "Hello",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("tok/s"), "{}", text(&out.stderr));

    // An unknown type names the presets; a quantized input is refused, naming the tensor and its type.
    let out = verity(&["quantize", i, "x.gguf", "--type", "q7_k"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("q4_k_m"),
        "{}",
        text(&out.stderr)
    );
    let out = verity(&[
        "quantize",
        q.to_str().unwrap(),
        dir.join("qq.gguf").to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("already"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `chat` with an image (`/image FILE`) on the tiny Qwen2.5-VL bundle: the image goes with the next message,
/// the next turn restores the whole conversation so far from the session's cache (image included); a file that
/// is not an image is said and the conversation goes on.
#[test]
fn chat_shows_images_with_the_next_message() {
    use std::io::Write;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures");
    let bundle = fixtures.join("vision/qwen25-vl");
    let image = fixtures.join("images/rgb.png");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_verity"))
        .args([
            "chat",
            "--model",
            bundle.to_str().unwrap(),
            "--max-tokens",
            "3",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let input = format!(
        "/image {}\n/image {}\nDescribe it.\nAnd again?\n\n",
        manifest.display(),
        image.display()
    );
    child
        .stdin
        .as_mut()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("not a PNG or JPEG"), "{err}");
    assert!(
        err.contains("[image 1 shown with the next message]"),
        "{err}"
    );
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("route ")).collect();
    assert_eq!(turns.len(), 2, "{err}");
    let count = |line: &str, what: &str| -> usize {
        let at = line.find(what).unwrap();
        line[..at]
            .rsplit([' ', '('])
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    // The first turn holds the image's 22 ids; the second restores at least them and the first turn's text.
    assert!(count(turns[0], " prompt tokens") >= 22, "{}", turns[0]);
    assert!(
        count(turns[1], " restored") >= count(turns[0], " prompt tokens"),
        "{}",
        turns[1]
    );
}

/// `run --image` on the tiny Qwen2.5-VL bundle: the 61 x 45 picture grows to the processor's minimum area (140 x
/// 112 pixels: 20 image rows), its block (`<|vision_start|>`, the rows, `<|vision_end|>`, no blank lines) joins
/// the prompt once per image, and an answer streams; `inspect` describes the bundle's vision side.
#[test]
fn run_takes_an_image_with_a_qwen25_vl_bundle() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures");
    let bundle = fixtures.join("vision/qwen25-vl");
    let image = fixtures.join("images/rgb.png");
    let (bundle, image) = (bundle.to_str().unwrap(), image.to_str().unwrap());
    let run = |images: usize| {
        let mut args = vec!["run", "--model", bundle, "--max-tokens", "3"];
        for _ in 0..images {
            args.extend(["--image", image]);
        }
        args.push("Describe it.");
        let out = verity(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let log = text(&out.stderr);
        assert!(log.contains("3 completion tokens"), "{log}");
        let at = log.find(" prompt tokens").unwrap();
        log[..at]
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    };
    let (none, one, two) = (run(0), run(1), run(2));
    assert_eq!((one - none, two - one), (22, 22));
    // `inspect` names the rotation's sections and the vision side.
    let out = verity(&["inspect", bundle]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("multimodal RoPE (2, 5, 5 pairs"), "{shown}");
    assert!(
        shown.contains("vision        Qwen2.5-VL's vision transformer (3 layers"),
        "{shown}"
    );
}

/// `run --image` on a tiny Gemma 3 image-text bundle: the image's block joins the prompt (text, a blank line,
/// `<start_of_image>`, 4 rows, `<end_of_image>`, a blank line) and an answer streams; a file that is not an
/// image, and a text-only bundle, give clear errors.
#[test]
fn run_takes_an_image_with_an_image_text_bundle() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures");
    let bundle = fixtures.join("vision/gemma3-vl");
    let image = fixtures.join("images/rgb.png");
    let (bundle, image) = (bundle.to_str().unwrap(), image.to_str().unwrap());
    let out = verity(&[
        "run",
        "--model",
        bundle,
        "--max-tokens",
        "4",
        "--image",
        image,
        "Describe it.",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = text(&out.stderr);
    assert!(log.contains("4 completion tokens"), "{log}");
    // Two images: the second's block of 6 ids and the blank lines between them.
    let two = verity(&[
        "run",
        "--model",
        bundle,
        "--max-tokens",
        "1",
        "--image",
        image,
        "--image",
        image,
        "Describe it.",
    ]);
    assert!(two.status.success(), "{}", text(&two.stderr));
    let tokens = |log: &str| -> usize {
        let at = log.find(" prompt tokens").unwrap();
        log[..at].rsplit(' ').next().unwrap().parse().unwrap()
    };
    let extra = tokens(&text(&two.stderr)) - tokens(&log);
    assert!(
        (7..=10).contains(&extra),
        "{extra} more ids for the second image"
    );
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let bad = verity(&[
        "run",
        "--model",
        bundle,
        "--image",
        manifest.to_str().unwrap(),
        "x",
    ]);
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("not a PNG or JPEG"),
        "{}",
        text(&bad.stderr)
    );
    let llama = fixture("llama-f32");
    let plain = verity(&[
        "run",
        "--model",
        llama.to_str().unwrap(),
        "--image",
        image,
        "x",
    ]);
    assert!(!plain.status.success());
    assert!(text(&plain.stderr).contains("not an image-text bundle"));
}

/// `bench conversation --image`: the image shows in each conversation's first turn and every turn sends it
/// again; turn 1 computes its features (`image_s` recorded), and turn 2 restores the first turn's whole prompt,
/// the image's rows included, from RAM and from disk after a restart.
#[test]
fn bench_conversation_takes_an_image_and_restores_it_in_the_follow_up() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verity/tests/fixtures");
    let dir = std::env::temp_dir().join(format!("verity-bench-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        r#"{"id":"c1","category":"conversation","turns":[{"role":"user","content":"What is in it?"},{"role":"user","content":"And the colours?"}]}"#,
    )
    .unwrap();
    let json = dir.join("out.json");
    let out = verity(&[
        "bench",
        "conversation",
        "--model",
        fixtures.join("vision/gemma3-vl").to_str().unwrap(),
        "--route",
        "ar",
        "--image",
        fixtures.join("images/rgb.png").to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-tokens",
        "4",
        "--repeat",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let records: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let of = |cache: &str, turn: u64| {
        records
            .iter()
            .find(|r| r["cache"] == cache && r["turn"] == turn)
            .unwrap_or_else(|| panic!("no {cache} turn {turn} record"))
    };
    for cache in ["off", "on", "disk"] {
        assert!(of(cache, 1)["image_s"].as_f64().unwrap() > 0.0);
    }
    // RAM, and disk after the restart (the queued stores landed first): turn 1's prompt, image included.
    for cache in ["on", "disk"] {
        let prompt1 = of(cache, 1)["prompt_tokens"].as_u64().unwrap();
        assert!(prompt1 > 4, "the image's rows are in the prompt");
        assert!(
            of(cache, 2)["restored_tokens"].as_u64().unwrap() >= prompt1 - 1,
            "{cache}: turn 2 restores less than turn 1's prompt"
        );
    }
    assert_eq!(of("off", 2)["restored_tokens"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}
