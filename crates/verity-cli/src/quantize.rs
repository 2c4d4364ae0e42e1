//! `verity quantize`: write a quantized GGUF from a GGUF of float weights or a Hugging Face safetensors folder.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use verity::bundle::gguf::GgufFile;
use verity::quantize::hf::write_gguf;
use verity::quantize::{plan, quantize, Plan, Preset};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF whose weights are F32, F16 or BF16, or a Hugging Face safetensors folder (dense Llama, Qwen2 or
    /// Qwen3), written first as a GGUF of its float weights beside the output.
    input: PathBuf,
    /// The GGUF to write.
    output: PathBuf,
    /// q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q8_0, q4_0, q4_1, q5_0, q5_1, q3_k_l, q3_k_m, q3_k_s, q2_k,
    /// f16, bf16 or f32 (llama.cpp's presets: the same type per tensor and the same blocks).
    #[arg(long = "type", value_name = "TYPE", default_value = "q4_k_m")]
    preset: String,
    /// Print each tensor's type and the sizes without writing the output (a safetensors folder is still
    /// converted to its temporary float GGUF first, to plan from).
    #[arg(long)]
    dry_run: bool,
}

/// A file removed when dropped: the GGUF a safetensors folder is converted to, whatever happens next.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub fn main(a: Args, threads: usize) -> Result<()> {
    let preset: Preset = a.preset.parse()?;
    let converted = if a.input.is_dir() {
        let mut name = a.output.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".float-{}.gguf", std::process::id()));
        let scratch = Scratch(a.output.with_file_name(name));
        eprintln!(
            "writing {} as a GGUF of its float weights",
            a.input.display()
        );
        write_gguf(&a.input, &scratch.0)?;
        Some(scratch)
    } else {
        None
    };
    let input = converted.as_ref().map_or(&a.input, |s| &s.0);
    if a.dry_run {
        let model = GgufFile::open(input)?;
        let plan = plan(&model, preset)?;
        for t in &plan.tensors {
            let note = t.fallback.as_deref().unwrap_or("");
            println!(
                "{:<40} {:>20} {:>6} -> {:<6} {note}",
                t.name,
                format!("{:?}", t.dims),
                t.from.name(),
                t.to.name()
            );
        }
        summary(&plan, None);
        return Ok(());
    }
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {msg} ({eta})")
            .expect("valid template"),
    );
    let start = Instant::now();
    let plan = quantize(input, &a.output, preset, threads, &mut |p| {
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
        bar.set_message(p.tensor.name.clone());
    })
    .with_context(|| format!("quantizing {} to {preset}", a.input.display()))?;
    bar.finish_and_clear();
    println!("wrote {}", a.output.display());
    summary(&plan, Some(start.elapsed().as_secs_f64()));
    Ok(())
}

fn summary(plan: &Plan, seconds: Option<f64>) {
    let values: u64 = plan
        .tensors
        .iter()
        .map(|t| t.dims.iter().product::<usize>() as u64)
        .sum();
    let fallbacks = plan.tensors.iter().filter(|t| t.fallback.is_some()).count();
    let mb = |b: u64| b as f64 / 1e6;
    print!(
        "{} {} tensors: {:.1} MB -> {:.1} MB ({:.2} bits per weight)",
        plan.preset,
        plan.tensors.len(),
        mb(plan.in_bytes()),
        mb(plan.out_bytes()),
        plan.out_bytes() as f64 * 8.0 / values.max(1) as f64
    );
    if let Some(s) = seconds {
        print!(" in {s:.1} s");
    }
    println!();
    if fallbacks > 0 {
        println!("{fallbacks} tensors fell back to a 32-value or F16 format (rows not whole 256-value blocks)");
    }
}
