use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use verity::bundle::{Bundle, Source};
use verity::chat::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// A bundle path or a known model name.
    path: String,
}

pub fn main(a: Args) -> Result<()> {
    let path: PathBuf = crate::load::resolve(&a.path)?;
    let b = Bundle::open(&path)?;
    let hp = &b.hparams;
    println!("bundle        {} ({})", path.display(), b.format_name());
    println!("architecture  {}", hp.arch.name());
    println!(
        "sizes         {} layers, hidden {}, {} heads / {} KV heads × {}, ffn {}, vocab {}, context {}",
        hp.n_layers, hp.hidden, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.ffn_hidden, hp.vocab, hp.context_len
    );
    println!(
        "rope          theta {}, {:?}; rms eps {}; tied embeddings {}; qkv bias {}; qk norm {}",
        hp.rope_theta, hp.rope_style, hp.rms_eps, hp.tied_embeddings, hp.qkv_bias, hp.qk_norm
    );
    if hp.rope_scaling != Default::default() {
        println!("rope scaling  {:?}", hp.rope_scaling);
    }
    let block = &hp.block;
    if block != &Default::default() {
        let mut parts = vec![format!("{:?} MLP", block.glu)];
        if block.post_norms {
            parts.push("post-norms".into());
        }
        if let Some(s) = block.embedding_scale {
            parts.push(format!("embeddings × {s}"));
        }
        if block.attention_scale.is_some() {
            parts.push(format!("attention scale {}", hp.attention_scale()));
        }
        if let Some(r) = block.rotary_dims {
            parts.push(format!("RoPE on {r} of {} values per head", hp.head_dim));
        }
        if block.attention_gate {
            parts.push("gated attention output".into());
        }
        if let Some([t, h, w]) = block.mrope {
            parts.push(format!(
                "multimodal RoPE ({t}, {h}, {w} pairs by temporal, height, width position)"
            ));
        }
        println!("block         {}", parts.join("; "));
    }
    if let Some(m) = &block.moe {
        let sparse = m.sparse.iter().filter(|&&s| s).count();
        println!(
            "experts       {} of {} per token, {} units each ({}), in {sparse} of {} layers",
            m.top_k,
            m.experts,
            m.ffn,
            if m.norm_top_k {
                "weights renormalized"
            } else {
                "softmax weights"
            },
            hp.n_layers
        );
        if let Some(shared) = m.shared_ffn {
            println!("              and a gated shared expert of {shared} units for every token");
        }
    }
    if let Some(la) = &block.linear {
        let linear = la.layers.iter().filter(|&&l| l).count();
        println!(
            "linear attn   Gated DeltaNet in {linear} of {} layers ({} key heads × {}, {} value heads × {}, \
             convolution of {}; a state of {:.1} kB per layer), full attention in the others",
            hp.n_layers,
            la.key_heads,
            la.key_dim,
            la.value_heads,
            la.value_dim,
            la.conv_kernel,
            (la.state_len() * 4) as f64 / 1000.0,
        );
    }
    if let Some(s) = &block.sliding {
        let local = s.local.iter().filter(|&&l| l).count();
        println!(
            "attention     {local} local layers (window {}, rope theta {}), {} global",
            s.window,
            s.rope_theta,
            hp.n_layers - local
        );
    }
    // Quantization per tensor kind: the kind is the name with layer numbers removed.
    let mut kinds: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut total_bytes = 0usize;
    let mut record = |name: &str, fmt: String, bytes: usize| {
        let kind: String = name
            .split('.')
            .filter(|p| p.parse::<usize>().is_err())
            .collect::<Vec<_>>()
            .join(".");
        *kinds.entry(kind).or_default().entry(fmt).or_default() += 1;
        total_bytes += bytes;
    };
    match &b.source {
        Source::Gguf(g) => {
            println!(
                "gguf          version {}, {} tensors, {} metadata keys",
                g.version,
                g.tensors.len(),
                g.metadata.len()
            );
            for t in &g.tensors {
                record(&t.name, t.ty.name().to_string(), t.range.len());
            }
        }
        Source::Safetensors {
            tensors, config, ..
        } => {
            println!(
                "safetensors   {} shards, {} tensors",
                tensors.shards.len(),
                tensors.tensors.len()
            );
            let quant = config
                .quantization
                .as_ref()
                .or(config.quantization_config.as_ref());
            for (name, t) in &tensors.tensors {
                // An MLX-quantized weight is reported as one tensor: its packed words plus scales and biases.
                let base = name.strip_suffix(".weight").unwrap_or(name);
                let quantized = tensors.get(&format!("{base}.scales")).is_some();
                if name.ends_with(".scales") || name.ends_with(".biases") {
                    let owner = name.rsplit_once('.').map_or("", |x| x.0);
                    if tensors.get(&format!("{owner}.weight")).is_some() {
                        continue;
                    }
                }
                let fmt = match (quantized, quant) {
                    (true, Some(q)) => {
                        let q = q.get(base).unwrap_or(q);
                        format!("mlx-affine-q{}-g{}", q["bits"], q["group_size"])
                    }
                    _ => t.dtype_name.clone(),
                };
                let extra: usize = [".scales", ".biases"]
                    .iter()
                    .filter_map(|s| tensors.get(&format!("{base}{s}")))
                    .map(|x| x.range.len())
                    .sum();
                record(name, fmt, t.range.len() + extra);
            }
        }
    }
    println!("weights       {:.1} MB", total_bytes as f64 / 1e6);
    println!("tensor kinds:");
    for (kind, fmts) in &kinds {
        let f: Vec<String> = fmts.iter().map(|(f, n)| format!("{f} ×{n}")).collect();
        println!("  {kind:<36} {}", f.join(", "));
    }
    match Tokenizer::from_bundle(&b) {
        Ok(t) => {
            let name = |id: Option<u32>| match id {
                Some(i) => format!("{:?} ({i})", t.token_str(i).unwrap_or_default()),
                None => "none".into(),
            };
            println!(
                "tokenizer     {} tokens; bos {}; eos {}; add bos {}",
                t.vocab_size(),
                name(t.bos),
                name(t.eos),
                t.add_bos
            );
            let stops: Vec<String> = t.stop_tokens.iter().map(|&i| name(Some(i))).collect();
            println!("stop tokens   {}", stops.join(", "));
            match &t.chat_template {
                Some(tpl) => println!("chat template {} chars:\n{}", tpl.len(), indent(tpl)),
                None => println!("chat template none (prompts are raw text)"),
            }
        }
        Err(e) => println!("tokenizer     unavailable: {e}"),
    }
    if path.is_dir() {
        // The vision side loads its tower on the first image: opening it reads the configs alone.
        let backend = std::sync::Arc::new(verity::backend::cpu::CpuBackend::new(1)?);
        if let Some(v) = verity::engine::VisionSide::open(&path, backend)? {
            println!("vision        {}", v.describe());
        }
    }
    println!("mtp head      {}", b.mtp.describe());
    println!("drafter       {}", b.drafter.describe());
    let plan = verity::speculative::plan(&b, &verity::speculative::SpecMode::Auto)?;
    println!(
        "speculation   auto → {} ({})",
        plan.route.name(),
        plan.reason
    );
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
