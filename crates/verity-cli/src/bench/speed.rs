//! `verity bench speed`: every prompt × turn × route × repeat, arms interleaved (for each repeat, for each
//! prompt, every route in turn) so that machine drift hits all routes alike, and every route decoding with the
//! same loaded model (its proposer swapped in) so that no route runs on its own copy of the weights.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use std::sync::Arc;
use std::time::Instant;

use verity::backend::Backend;

use crate::device::{Device, WithBackend};
use verity::chat::{Message, TemplateArgs};
use verity::engine::{Engine, GenerateRequest, IMAGE_SLOT};
use verity::sample::SamplerConfig;
use verity::speculative::SpecMode;
use verity::vision::ImageLimits;

use super::prompts::{self, BenchPrompt};
use super::summary::{self, Record};

#[derive(clap::Args)]
pub struct Args {
    /// A bundle path or a known model name.
    #[arg(long, default_value = verity_registry::DEFAULT_MODEL)]
    model: String,
    /// Comma-separated routes: ar, copy, mtp, drafter, draft_model, auto.
    #[arg(long, default_value = "ar")]
    routes: String,
    /// The draft model of the draft_model route (default: the target itself, i.e. self-drafting).
    #[arg(long)]
    draft_model: Option<String>,
    #[arg(long, default_value = "bench/prompts.jsonl")]
    prompts: PathBuf,
    /// Only the prompts with these ids (comma-separated).
    #[arg(long)]
    ids: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Write the records here as a JSON list ("-" = stdout).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the summary as DIR/speed.png (the folder is created).
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        run(self, backend)
    }
}

fn run<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    // The folder first, so that an unusable one fails before the measurement.
    let plot = a
        .plot
        .as_deref()
        .map(|dir| super::plot::png_path(dir, "speed"))
        .transpose()?;
    let routes: Vec<String> = a
        .routes
        .split(',')
        .map(|s| s.trim().replace('-', "_"))
        .collect();
    let mut prompts = prompts::load(&a.prompts)?;
    if let Some(ids) = &a.ids {
        let ids: Vec<&str> = ids.split(',').collect();
        prompts.retain(|p| ids.contains(&p.id.as_str()));
    }
    if prompts.is_empty() {
        bail!("no prompts selected from {}", a.prompts.display());
    }
    let target = crate::load::resolve(&a.model)?;
    let target = target.to_str().context("model path is not UTF-8")?;
    // One model for every route, each route's proposer swapped in for its runs: two copies of the weights may
    // land differently in memory and run several per cent apart, which a ratio must not measure.
    let mut engine = crate::load::engine_on(target, backend.clone(), &SpecMode::Off)?;
    let mut proposers = Vec::new();
    for r in &routes {
        let mode = route_mode(r, a.draft_model.as_deref().unwrap_or(target))?;
        let route = engine
            .route_for(Path::new(target), &mode)
            .with_context(|| format!("route {r}"))?;
        proposers.push(Some(route));
    }
    let req = GenerateRequest {
        max_tokens: a.max_tokens,
        sampling: SamplerConfig {
            temperature: a.temperature,
            seed: a.seed,
            ..SamplerConfig::default()
        },
        ..Default::default()
    };
    let mut records = Vec::new();
    for repeat in 0..a.repeat {
        for p in &prompts {
            for (route, slot) in routes.iter().zip(proposers.iter_mut()) {
                let (plan, proposer) = slot.take().expect("returned after its runs");
                let own = engine.swap_route(plan, proposer);
                let runs = run_prompt(&mut engine, p, route, repeat, &req, Turns::OneSession, None);
                *slot = Some(engine.swap_route(own.0, own.1));
                records.extend(runs?);
            }
        }
    }
    write_json(a.json.as_deref(), &records)?;
    summary::print(&records);
    if let Some(path) = &plot {
        super::plot::speed(&records, &super::plot::model_title(&a.model), path)?;
        eprintln!("plot: {}", path.display());
    }
    if a.temperature == 0.0 {
        let differ = differs_from_ar(&records);
        if !differ.is_empty() {
            bail!(
                "greedy output differs from the ar route's in {} records (the speeds above are not valid): {}",
                differ.len(),
                differ.join(", ")
            );
        }
    }
    Ok(())
}

/// The records whose text is not the `ar` record's of the same prompt, turn and repeat (`route prompt/turn/
/// repeat`): with greedy decoding every route must give AR's text. Nothing where `ar` was not run.
pub fn differs_from_ar(records: &[Record]) -> Vec<String> {
    let ar: std::collections::HashMap<(&str, usize, usize), &str> = records
        .iter()
        .filter(|r| r.route == "ar")
        .map(|r| ((r.prompt_id.as_str(), r.turn, r.repeat), r.text.as_str()))
        .collect();
    records
        .iter()
        .filter(|r| {
            ar.get(&(r.prompt_id.as_str(), r.turn, r.repeat))
                .is_some_and(|&t| t != r.text)
        })
        .map(|r| format!("{} {}/{}/{}", r.route, r.prompt_id, r.turn, r.repeat))
        .collect()
}

/// The speculation mode of a benchmark route name (`ar`, `copy`, `mtp`, `drafter`, `draft_model`, `auto`).
pub fn route_mode(route: &str, draft_model: &str) -> Result<SpecMode> {
    Ok(match route {
        "ar" => SpecMode::Off,
        "copy" => SpecMode::Copy,
        "mtp" => SpecMode::Mtp,
        "drafter" => SpecMode::Drafter,
        "auto" => SpecMode::Auto,
        "draft_model" => SpecMode::DraftModel(Some(crate::load::resolve(draft_model)?)),
        other => bail!("unknown route {other:?} (ar, copy, mtp, drafter, draft_model, auto)"),
    })
}

/// How the turns of a conversation share state.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Turns {
    /// One session for all turns (a chat client's connection).
    OneSession,
    /// A fresh session per turn: only the prefix cache can restore anything.
    FreshSessions,
    /// As after a restart before every turn but the first: a fresh session and every conversation forgotten
    /// (the RAM tier, the proposer's state); only the disk tier can restore anything.
    Restarted,
}

/// Run every turn of `p` (appending each answer) and record each turn. With `image` (PNG or JPEG bytes) the
/// first user message shows it, and every turn sends it again, as a chat client does: each turn's record says
/// how long the image took (`image_s`: checking its bytes, and computing its features where a forward needed
/// them — the tower's time, inside the turn's time to first token; nothing more where the vision side kept the
/// features or every image row restored from the prefix cache).
pub fn run_prompt<B: Backend>(
    engine: &mut Engine<B>,
    p: &BenchPrompt,
    route: &str,
    repeat: usize,
    req: &GenerateRequest,
    turns: Turns,
    image: Option<&[u8]>,
) -> Result<Vec<Record>> {
    let mut sess = engine.new_session();
    let mut messages: Vec<Message> = Vec::new();
    let mut out = Vec::new();
    for (ti, turn) in p.turns().into_iter().enumerate() {
        if turns != Turns::OneSession && ti > 0 {
            engine.end_session(sess);
            if turns == Turns::Restarted {
                // A restart lets the queued disk stores land first (the engine's drop waits for them).
                drop(engine.prefix_disk());
                engine.forget_conversations();
            }
            sess = engine.new_session();
        }
        let first = messages.is_empty();
        messages.extend(turn);
        if first && image.is_some() {
            let user = messages
                .iter_mut()
                .find(|m| m.role == "user")
                .context("a turn without a user message")?;
            user.content = format!("{IMAGE_SLOT}{}", user.content);
        }
        let t = Instant::now();
        let tower_before = engine.vision.as_ref().map(|v| v.tower_time());
        let images = match image {
            Some(bytes) => {
                let vision = engine
                    .vision
                    .as_ref()
                    .context("--image: the model has no vision tower")?;
                vec![vision.image(bytes, &ImageLimits::default())?]
            }
            None => Vec::new(),
        };
        let checked_s = t.elapsed().as_secs_f64();
        let rendered = if images.is_empty() {
            engine.render_chat(&messages, &TemplateArgs::default())?
        } else {
            engine.render_chat_with_images(&messages, &images)?
        };
        let (prompt, boundary) = (rendered.tokens, rendered.boundary);
        let req = GenerateRequest {
            constraint: None,
            store_prefix: boundary,
            images,
            ..req.clone()
        };
        let mut ids = Vec::new();
        let stats = engine
            .generate(&mut sess, &prompt, &req, |_, emitted| {
                ids.push(emitted.id);
                true
            })
            .with_context(|| format!("prompt {} turn {}", p.id, ti + 1))?;
        let tower_s = match (&engine.vision, tower_before) {
            (Some(v), Some(before)) => (v.tower_time() - before).as_secs_f64(),
            _ => 0.0,
        };
        let image_s = if image.is_some() {
            checked_s + tower_s
        } else {
            0.0
        };
        let text = engine.tokenizer.decode(&ids)?;
        messages.push(Message::new("assistant", &text));
        let rec = Record {
            prompt_id: p.id.clone(),
            category: p.category.clone(),
            turn: ti + 1,
            route: route.to_string(),
            repeat,
            prompt_tokens: stats.prompt_tokens,
            restored_tokens: stats.restored_tokens,
            completion_tokens: stats.completion_tokens,
            ttft_s: stats.ttft_s,
            decode_tok_s: stats.decode_tok_s(),
            cycles: stats.cycles,
            accepted_per_cycle: stats.tokens_per_cycle(),
            verify_rows: stats.cycles + stats.drafted,
            draft_s: stats.draft_s,
            verify_s: stats.verify_s,
            other_s: stats.other_s,
            text,
            cache: None,
            store_s: stats.store_s,
            image_s,
        };
        eprintln!(
            "{:<14} turn {} {:<11} rep {}: {:>4} tokens, {:>6.1} tok/s, {:.2} tok/cycle, ttft {:.3} s, restored {}",
            rec.prompt_id,
            rec.turn,
            rec.route,
            repeat,
            rec.completion_tokens,
            rec.decode_tok_s,
            rec.accepted_per_cycle,
            rec.ttft_s,
            rec.restored_tokens
        );
        out.push(rec);
    }
    engine.end_session(sess);
    Ok(out)
}

/// Write records as a JSON list to `path` ("-" = stdout).
pub fn write_json(path: Option<&std::path::Path>, records: &[Record]) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let json = serde_json::to_string_pretty(records)?;
    if path.as_os_str() == "-" {
        println!("{json}");
    } else {
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(route: &str, prompt: &str, turn: usize, repeat: usize, text: &str) -> Record {
        serde_json::from_value(serde_json::json!({
            "prompt_id": prompt, "category": "code", "turn": turn, "route": route, "repeat": repeat,
            "prompt_tokens": 1, "restored_tokens": 0, "completion_tokens": 1, "ttft_s": 0.0,
            "decode_tok_s": 1.0, "cycles": 1, "accepted_per_cycle": 1.0, "draft_s": 0.0, "verify_s": 0.0,
            "other_s": 0.0, "text": text
        }))
        .unwrap()
    }

    #[test]
    fn a_route_whose_greedy_text_is_not_ars_is_named_with_its_prompt_turn_and_repeat() {
        let records = [
            rec("ar", "p", 1, 0, "a"),
            rec("ar", "p", 2, 0, "b"),
            rec("ar", "p", 1, 1, "a"),
            rec("mtp", "p", 1, 0, "a"),
            rec("mtp", "p", 2, 0, "c"),
            rec("copy", "p", 1, 1, "a"),
            rec("copy", "q", 1, 0, "z"), // no ar record to compare with
        ];
        assert_eq!(differs_from_ar(&records), ["mtp p/2/0"]);
        assert!(differs_from_ar(&records[..4]).is_empty());
    }
}
