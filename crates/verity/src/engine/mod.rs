//! The request loop: prompt → prefill (reusing the longest cached prefix) → decode cycles → stream tokens.
//!
//! Split by stage: [`request`] (what a caller asks and gets back per token), [`session`] (a conversation's
//! state between turns), [`prompt`] (chat rendering), [`prefill`] (restore, then prefill the rest, storing the
//! canonical checkpoint), [`decode`] (propose → verify → commit → emit). The route was decided once, at load
//! ([`crate::speculative::build`]).

mod batch;
mod decode;
mod media;
mod prefill;
mod prompt;
mod request;
mod session;
mod stats;

use std::path::Path;
use std::sync::Arc;

pub use batch::Decoding;
pub use media::{
    content_key, is_media, ImageFeatures, PromptImage, VisionSide, FEATURE_CACHE_IMAGES, MEDIA_BIT,
};
pub use prompt::{ChatPrompt, IMAGE_SLOT};
pub use request::{Emitted, GenerateRequest, Logprobs};
pub use session::Session;
pub use stats::{GenerationStats, StopReason};

use crate::backend::Backend;
use crate::bundle::Bundle;
use crate::cache::{CheckpointShape, DiskTier, KvCache, PrefixTiers};
use crate::chat::{ChatTemplate, Tokenizer};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::speculative::{self, BatchGate, Plan, Proposer, RowCost, SpecMode};
use prefill::Prefilled;

pub struct Engine<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    pub plan: Plan,
    proposer: Option<Box<dyn Proposer>>,
    /// Checkpoints of earlier prompts, in RAM and on disk (both off until set).
    prefix: PrefixTiers,
    /// Identifies the model's weights in the disk tier ([`Bundle::fingerprint`]).
    fingerprint: u64,
    /// Caches of ended sessions, handed to new ones ([`Engine::end_session`]).
    spare: Vec<KvCache<B>>,
    /// Whether requests in batched steps draft ([`Engine::set_batch_drafts`]), the steps' forward time by row
    /// count, which prices their drafted rows, and whether drafting measurably paid.
    batch_drafts: bool,
    step_cost: RowCost,
    batch_gate: BatchGate,
    /// An image-text bundle's vision side.
    pub vision: Option<VisionSide<B>>,
}

/// Ended sessions' caches kept for new ones. A cache keeps its buffers (and the capacity they grew to), so a
/// new session's forwards run on the same buffers as the last one's: a backend that records forwards per
/// buffer set (CUDA graphs) replays them instead of recording every shape again for every request, and no
/// allocation happens per request. More than a worker's session and a spare would only hold memory.
const SPARE_CACHES: usize = 2;

impl<B: Backend> Engine<B> {
    /// Load a bundle and set up the speculative route `mode` resolves to.
    pub fn load(path: &Path, backend: Arc<B>, mode: &SpecMode) -> Result<Self> {
        let bundle = Bundle::open(path)?;
        let tokenizer = Tokenizer::from_bundle(&bundle)?;
        let model = Model::load(&bundle, backend.clone())?;
        if tokenizer.vocab_size() > model.hp.vocab {
            return Err(Error::Invalid(format!(
                "the tokenizer has {} tokens but the model only {}",
                tokenizer.vocab_size(),
                model.hp.vocab
            )));
        }
        let template = match &tokenizer.chat_template {
            Some(src) => {
                let tok_str =
                    |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i)).unwrap_or_default();
                Some(ChatTemplate::new(
                    src,
                    &tok_str(tokenizer.bos),
                    &tok_str(tokenizer.eos),
                )?)
            }
            None => None,
        };
        let vision = if bundle.path.is_dir() {
            VisionSide::open(&bundle.path, backend.clone())?
        } else {
            None
        };
        let (plan, proposer) = speculative::build(&bundle, &model, &tokenizer, backend, mode)?;
        Ok(Engine {
            model,
            tokenizer,
            template,
            plan,
            proposer,
            prefix: PrefixTiers::default(),
            fingerprint: bundle.fingerprint(),
            spare: Vec::new(),
            batch_drafts: false,
            step_cost: RowCost::new(batch::STEP_ROWS),
            batch_gate: BatchGate::default(),
            vision,
        })
    }

    /// Let requests in batched steps draft on a speculative route, each copying from its own context (off by
    /// default: on a 2-core CPU, where a batch's forward costs about the same per row, the drafted rows cost the
    /// batch more than they gave — BENCHMARKS.md, "Server under load"). Requests started before keep their
    /// setting; no answer changes either way.
    pub fn set_batch_drafts(&mut self, on: bool) {
        self.batch_drafts = on;
    }

    /// Keep prefix-cache checkpoints up to `bytes` in RAM (0 turns the RAM tier off and drops what it holds).
    pub fn set_prefix_cache_budget(&mut self, bytes: usize) {
        self.prefix.set_ram_budget(bytes);
    }

    /// Persist prefix-cache checkpoints under `root` (a folder per model fingerprint and backend numerics, so a
    /// checkpoint is only restored by the same weights computing the same bits), up to `quota` bytes.
    /// Returns false (with a warning logged) when the folder cannot be used; generation is unaffected.
    pub fn set_prefix_cache_dir(&mut self, root: &Path, quota: u64) -> bool {
        let hp = &self.model.hp;
        let shape = CheckpointShape {
            n_layers: hp.n_layers,
            kv_dim: hp.n_kv_heads * hp.head_dim,
            hidden: hp.hidden,
            states: (0..hp.n_layers)
                .map(|l| match &hp.block.linear {
                    Some(la) if la.layers[l] => la.state_len(),
                    _ => 0,
                })
                .collect(),
        };
        let disk = DiskTier::open(
            root,
            self.fingerprint,
            &self.model.backend().numerics(),
            shape,
            quota,
        );
        let usable = disk.is_some();
        self.prefix.set_disk(disk);
        usable
    }

    /// Stop using the disk tier (once its queued stores have landed); its files stay.
    pub fn close_prefix_cache_dir(&mut self) {
        self.prefix.set_disk(None);
    }

    /// The prefix cache's RAM tier: checkpoints held and their bytes.
    pub fn prefix_cache_ram(&self) -> (usize, usize) {
        self.prefix.ram_usage()
    }

    /// The disk tier, if one is set, once every checkpoint handed to it has been written.
    pub fn prefix_disk(&self) -> Option<std::sync::MutexGuard<'_, DiskTier>> {
        self.prefix.disk()
    }

    /// Forget every conversation as a restart would, keeping the disk tier's files: the RAM prefix tier, the
    /// spare sessions' caches, the proposer's state (an MTP head's or a draft model's cache, the copy index) and
    /// the images' features the vision side kept.
    pub fn forget_conversations(&mut self) {
        self.prefix.clear_ram();
        self.spare.clear();
        if let Some(p) = self.proposer.as_mut() {
            p.forget();
        }
        if let Some(v) = &self.vision {
            v.forget_images();
        }
    }

    /// Drop every prefix-cache checkpoint, in RAM and on disk.
    pub fn clear_prefix_cache(&mut self) {
        self.prefix.clear();
    }

    /// The plan and proposer of route `mode` over this engine's model (`bundle`: the folder or file it was
    /// loaded from). Side-by-side measurements of routes share one model's weights this way, so that no route's
    /// speed depends on where its own copy of the weights landed in memory.
    pub fn route_for(
        &self,
        bundle: &Path,
        mode: &SpecMode,
    ) -> Result<(Plan, Option<Box<dyn Proposer>>)> {
        let bundle = Bundle::open(bundle)?;
        speculative::build(
            &bundle,
            &self.model,
            &self.tokenizer,
            self.model.backend().clone(),
            mode,
        )
    }

    /// Decode with `plan` and `proposer` from now on; returns the route decoded with until now.
    pub fn swap_route(
        &mut self,
        plan: Plan,
        proposer: Option<Box<dyn Proposer>>,
    ) -> (Plan, Option<Box<dyn Proposer>>) {
        (
            std::mem::replace(&mut self.plan, plan),
            std::mem::replace(&mut self.proposer, proposer),
        )
    }

    /// Replace the proposer (tests drive the loop with adversarial proposers through this).
    pub fn set_proposer(&mut self, proposer: Option<Box<dyn Proposer>>) {
        self.proposer = proposer;
    }

    /// An empty session: on an ended session's cache where one is spare, else on a new one.
    pub fn new_session(&mut self) -> Session<B> {
        let cache = match self.spare.pop() {
            Some(mut cache) => {
                cache.truncate(0);
                cache
            }
            None => self.model.new_cache(self.model.hp.context_len),
        };
        Session::new(cache)
    }

    /// End `sess`, keeping its cache's buffers for a later [`Engine::new_session`].
    pub fn end_session(&mut self, sess: Session<B>) {
        if self.spare.len() < SPARE_CACHES {
            self.spare.push(sess.cache);
        }
    }
}
