use std::io::{BufRead, Write};

use std::sync::Arc;

use anyhow::Result;
use verity::backend::Backend;
use verity::chat::Message;
use verity::engine::IMAGE_SLOT;

use crate::device::{with_backend, Device, WithBackend};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    gen: crate::run::GenArgs,
}

/// A read-eval loop over stdin. The session keeps the KV cache of the conversation, so each turn prefills only
/// the tokens the previous turn did not already cache. `/image FILE` shows an image (PNG or JPEG) with the next
/// message, on an image-text bundle; the conversation keeps its images, so later turns restore them from the
/// cache.
pub fn main(a: Args, device: Device, threads: usize) -> Result<()> {
    with_backend(device, threads, a)
}

impl WithBackend for Args {
    type Out = ();
    fn run<B: Backend>(self, backend: Arc<B>, _: Device) -> Result<()> {
        chat(self, backend)
    }
}

fn chat<B: Backend>(a: Args, backend: Arc<B>) -> Result<()> {
    let mut engine = crate::load::engine_on(&a.gen.model, backend, &a.gen.speculation)?;
    let mut sess = engine.new_session();
    let mut messages = a.gen.first_messages();
    let mut req = a.gen.request();
    // The conversation's images in order, and how many of them the next message shows.
    let mut pending = 0;
    let stdin = std::io::stdin();
    eprintln!("verity chat — empty line or Ctrl-D to quit, /reset to start over, /image FILE to show an image");
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            break;
        }
        if line == "/reset" {
            messages = a.gen.first_messages();
            req.images.clear();
            pending = 0;
            continue;
        }
        if let Some(path) = line.strip_prefix("/image ") {
            // A bad file or a text-only bundle is said and the conversation goes on.
            match crate::run::image(&engine, std::path::Path::new(path.trim())) {
                Ok(img) => {
                    req.images.push(img);
                    pending += 1;
                    eprintln!("[image {} shown with the next message]", req.images.len());
                }
                Err(e) => eprintln!("[{e:#}]"),
            }
            continue;
        }
        let slots: String = std::iter::repeat_n(IMAGE_SLOT, pending).collect();
        pending = 0;
        messages.push(Message::new("user", &format!("{slots}{line}")));
        let prompt = if req.images.is_empty() {
            engine.chat_prompt(&messages)?
        } else {
            engine
                .render_chat_with_images(&messages, &req.images)?
                .tokens
        };
        let (ids, stats) = crate::run::stream(&mut engine, &mut sess, &prompt, &req)?;
        println!();
        eprintln!("[{}]", stats.summary());
        messages.push(Message::new("assistant", &engine.tokenizer.decode(&ids)?));
    }
    Ok(())
}
