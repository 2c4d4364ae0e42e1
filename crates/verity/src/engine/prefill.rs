//! Prefill: bring a session's cache to a prompt, restoring the longest cached prefix first and storing the
//! canonical checkpoint on the way.

use std::time::Instant;

use super::media::{self, MediaTable};
use super::{Engine, GenerateRequest, Session};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::LogitRows;
use crate::model::TargetFeatures;
use crate::speculative::Proposer;

/// What prefill reused and what storing cost.
pub(super) struct Prefilled {
    /// Prompt tokens whose state came from the session or the prefix cache.
    pub restored: usize,
    /// Seconds spent storing the checkpoint.
    pub store_s: f64,
}

impl<B: Backend> Engine<B> {
    /// Keep a checkpoint of the session's committed state for `tokens`, in RAM and on disk, with the target
    /// states the proposer conditions on of every position, where the session kept them all; returns the
    /// seconds it took. A device fault while the state is read back is the error (nothing is stored: the
    /// copy would be garbage).
    pub(super) fn store_checkpoint(&mut self, sess: &Session<B>, tokens: &[u32]) -> Result<f64> {
        let t = Instant::now();
        let mut ckpt = sess.cache.checkpoint(self.model.backend());
        if let Some(fault) = self.model.backend().take_fault() {
            return Err(Error::Device(fault));
        }
        let kind = &sess.hidden.kind;
        if let Some(rows) = sess.hidden.leading_rows(tokens.len()) {
            let width = kind.width(self.model.hp.hidden);
            ckpt = ckpt.with_hidden(kind.clone(), width, rows.to_vec());
        }
        self.prefix.store(tokens, ckpt);
        Ok(t.elapsed().as_secs_f64())
    }

    /// After an answer to a request that stores checkpoints, keep the state after the answer too: the next
    /// turn's prompt usually re-tokenizes it to the same ids, so the follow-up restores the answer as well.
    /// Taken from the live cache, never by replaying; returns the seconds it took (0 when nothing is stored).
    pub(super) fn store_answer(
        &mut self,
        sess: &Session<B>,
        req: &GenerateRequest,
        prompt_len: usize,
    ) -> Result<f64> {
        if req.store_prefix.is_none() || !self.prefix.enabled() || sess.tokens.len() <= prompt_len {
            return Ok(0.0);
        }
        let tokens = sess.tokens.clone();
        self.store_checkpoint(sess, &tokens)
    }

    /// Bring the session's cache to `prompt[..len - 1]`, reusing the session's cached prefix or the longest
    /// prefix-cache checkpoint, whichever is longer; the last prompt token stays out of the cache (it starts the
    /// first decode cycle). A checkpoint is stored when prefill passes `store_at`.
    pub(super) fn prefill(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        media: &MediaTable,
        store_at: Option<usize>,
        proposer: Option<&mut (dyn Proposer + 'static)>,
    ) -> Result<Prefilled> {
        let features = proposer
            .as_deref()
            .map(|p| p.features())
            .unwrap_or_default();
        let mut plan = self.prefill_plan(sess, prompt, store_at, &features)?;
        let body = &prompt[..prompt.len() - 1];
        while let Some(end) = plan.next_end(body.len()) {
            let end = media::chunk_end(body, end);
            let chunk = media.batch(body, plan.pos, end)?;
            if !features.is_none() {
                let out = self.model.forward_features(
                    &mut sess.cache,
                    &chunk,
                    LogitRows::None,
                    &features,
                )?;
                let width = features.width(self.model.hp.hidden);
                sess.hidden.push(plan.pos, &out.features, &features, width);
            } else {
                self.model
                    .forward(&mut sess.cache, &chunk, LogitRows::None, &[])?;
            }
            self.prefilled_chunk(sess, body, &mut plan, end)?;
        }
        if let Some(p) = proposer {
            sess.hidden.hand_to(p, &features, body.len());
        }
        Ok(plan.done)
    }

    /// Where a prompt's prefill starts: the session's cached prefix or the longest prefix-cache checkpoint
    /// restored (with the target states `features` names, where the checkpoint has them), the session cut there.
    pub(super) fn prefill_plan(
        &mut self,
        sess: &mut Session<B>,
        prompt: &[u32],
        store_at: Option<usize>,
        features: &TargetFeatures,
    ) -> Result<PrefillPlan> {
        let body = &prompt[..prompt.len() - 1];
        let mut common = sess
            .tokens
            .iter()
            .zip(body)
            .take_while(|(a, b)| a == b)
            .count();
        let backend = self.model.backend();
        let (cache, hidden) = (&mut sess.cache, &mut sess.hidden);
        let restored = self.prefix.restore_longest(body, common, |ckpt| {
            // The proposer's target states come back with the K/V, so it conditions on the whole prefix (states
            // of another kind, kept for another route, are not its: its context restarts after the prefix).
            hidden.truncate(0);
            if let Some(rows) = ckpt.hidden().filter(|r| r.features == *features) {
                hidden.push(0, &rows.rows, features, rows.width);
            }
            cache.restore(backend, ckpt)
        })?;
        if let Some(m) = restored {
            sess.tokens.clear();
            sess.tokens.extend_from_slice(&body[..m]);
            common = m;
        }
        let common = sess.truncate(common);
        Ok(PrefillPlan {
            pos: common,
            rows: self.model.backend().prefill_rows(),
            store_at: store_at.filter(|&b| b > common && b <= body.len() && self.prefix.enabled()),
            done: Prefilled {
                restored: common,
                store_s: 0.0,
            },
        })
    }

    /// After the forward of `body[plan.pos..end]` into the session's cache: the tokens recorded, and the
    /// checkpoint stored where the chunk ends at the canonical boundary.
    pub(super) fn prefilled_chunk(
        &mut self,
        sess: &mut Session<B>,
        body: &[u32],
        plan: &mut PrefillPlan,
        end: usize,
    ) -> Result<()> {
        sess.tokens.extend_from_slice(&body[plan.pos..end]);
        plan.pos = end;
        if Some(end) == plan.store_at {
            plan.done.store_s = self.store_checkpoint(sess, &body[..end])?;
        }
        Ok(())
    }
}

/// A prompt's prefill under way: the next position to compute, where the canonical checkpoint is taken, and
/// what was reused and what storing cost.
pub(super) struct PrefillPlan {
    pub(super) pos: usize,
    /// Rows per chunk (`Backend::prefill_rows`).
    rows: usize,
    store_at: Option<usize>,
    pub(super) done: Prefilled,
}

impl PrefillPlan {
    /// The end of the next chunk of a prompt body of `len` tokens (chunks end at the canonical boundary, so the
    /// checkpoint is taken exactly there), or `None` once the body is in the cache.
    pub(super) fn next_end(&self, len: usize) -> Option<usize> {
        (self.pos < len).then(|| match self.store_at {
            Some(b) if self.pos < b => (self.pos + self.rows).min(b),
            _ => (self.pos + self.rows).min(len),
        })
    }
}
