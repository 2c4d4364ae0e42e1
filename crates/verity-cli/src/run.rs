use std::io::Write;

use std::sync::Arc;

use anyhow::{Context, Result};
use verity::backend::Backend;

use crate::device::{with_backend, Device, WithBackend};
use verity::chat::{Message, StreamDecoder};
use verity::engine::{GenerateRequest, IMAGE_SLOT};
use verity::sample::SamplerConfig;
use verity::speculative::SpecMode;
use verity::vision::ImageLimits;
use verity_registry as registry;

/// Generation settings shared by `run` and `chat`.
#[derive(clap::Args, Clone)]
pub struct GenArgs {
    /// A bundle path or a known model name.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    pub model: String,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// 0 = off.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Optional system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Speculative decoding: auto, off, copy, mtp, drafter, draft-model=PATH.
    #[arg(long, default_value = "auto")]
    pub speculation: SpecMode,
}

impl GenArgs {
    pub fn request(&self) -> GenerateRequest {
        GenerateRequest {
            max_tokens: self.max_tokens,
            sampling: SamplerConfig {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repeat_penalty,
                seed: self.seed,
            },
            ..Default::default()
        }
    }

    pub fn first_messages(&self) -> Vec<Message> {
        self.system
            .iter()
            .map(|s| Message::new("system", s))
            .collect()
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    gen: GenArgs,
    /// The prompt (a user message; raw text for bundles without a chat template).
    prompt: String,
    /// An image (PNG or JPEG) shown before the prompt's text; repeat for several. Needs an image-text bundle.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<std::path::PathBuf>,
}

pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    with_backend(device, threads, a)
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        let a = self;
        let mut engine = crate::load::engine_on(&a.gen.model, backend, &a.gen.speculation)?;
        if !engine.has_chat_template() {
            eprintln!("[no chat template (a base model): the prompt is continued as raw text]");
        }
        let mut messages = a.gen.first_messages();
        let mut req = a.gen.request();
        let prompt = if a.images.is_empty() {
            messages.push(Message::new("user", &a.prompt));
            engine.chat_prompt(&messages)?
        } else {
            for path in &a.images {
                let img = image(&engine, path).with_context(|| a.gen.model.clone())?;
                req.images.push(img);
            }
            let slots: String = std::iter::repeat_n(IMAGE_SLOT, a.images.len()).collect();
            messages.push(Message::new("user", &format!("{slots}{}", a.prompt)));
            engine
                .render_chat_with_images(&messages, &req.images)?
                .tokens
        };
        let mut sess = engine.new_session();
        let (_, stats) = stream(&mut engine, &mut sess, &prompt, &req)?;
        eprintln!("\n[{}]", stats.summary());
        Ok(())
    }
}

/// The image file `path` (PNG or JPEG) as a prompt's image, for `engine`'s vision side.
pub fn image<B: Backend>(
    engine: &verity::engine::Engine<B>,
    path: &std::path::Path,
) -> Result<verity::engine::PromptImage> {
    let vision = engine
        .vision
        .as_ref()
        .context("not an image-text bundle (no vision tower)")?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    vision
        .image(&bytes, &ImageLimits::default())
        .with_context(|| path.display().to_string())
}

/// Generate and stream text to stdout; returns the completion's token ids and the statistics.
pub fn stream<B: Backend>(
    engine: &mut verity::engine::Engine<B>,
    sess: &mut verity::engine::Session<B>,
    prompt: &[u32],
    req: &GenerateRequest,
) -> Result<(Vec<u32>, verity::engine::GenerationStats)> {
    let mut ids = Vec::new();
    let mut dec = StreamDecoder::new();
    let mut out = std::io::stdout().lock();
    let mut err = None;
    let stats = engine.generate(sess, prompt, req, |tok, emitted| {
        let t = emitted.id;
        ids.push(t);
        match dec.push(tok, t) {
            Ok(Some(text)) => {
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
                true
            }
            Ok(None) => true,
            Err(e) => {
                err = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    Ok((ids, stats))
}
