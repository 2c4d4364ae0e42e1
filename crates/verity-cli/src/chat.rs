use std::io::{BufRead, Write};

use std::sync::Arc;

use anyhow::Result;
use verity::backend::Backend;
use verity::chat::Message;

use crate::device::{with_backend, Device, WithBackend};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    gen: crate::run::GenArgs,
}

/// A read-eval loop over stdin. The session keeps the KV cache of the conversation, so each turn prefills only
/// the tokens the previous turn did not already cache.
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
    let req = a.gen.request();
    let stdin = std::io::stdin();
    eprintln!("verity chat — empty line or Ctrl-D to quit, /reset to start over");
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
            continue;
        }
        messages.push(Message::new("user", line));
        let prompt = engine.chat_prompt(&messages)?;
        let (ids, stats) = crate::run::stream(&mut engine, &mut sess, &prompt, &req)?;
        println!();
        eprintln!("[{}]", stats.summary());
        messages.push(Message::new("assistant", &engine.tokenizer.decode(&ids)?));
    }
    Ok(())
}
