//! Constrained decoding: a grammar (JSON schema, tool-call format) that decides which tokens may come next.
//!
//! The engine applies a constraint on the verified AR path: before the next token is chosen, every token the
//! grammar rules out gets probability zero, so greedy and sampled choices both stay inside the grammar. (Drafts
//! are not checked against the grammar, so speculation is off for constrained requests.)

use std::sync::{Arc, Mutex};

use crate::error::Result;

pub trait Constraint: Send {
    /// Set `allowed[t]` for every token `t` the grammar accepts next (`allowed` is all false on entry and as
    /// long as the model's vocabulary).
    fn allowed(&mut self, allowed: &mut [bool]) -> Result<()>;
    /// Advance the grammar past `token`.
    fn commit(&mut self, token: u32) -> Result<()>;
    /// The grammar is complete and allows nothing more: generation ends.
    fn finished(&self) -> bool;
}

/// A request's constraint, shareable through a cloneable request.
#[derive(Clone)]
pub struct SharedConstraint(pub Arc<Mutex<dyn Constraint>>);

impl SharedConstraint {
    pub fn new(c: impl Constraint + 'static) -> Self {
        SharedConstraint(Arc::new(Mutex::new(c)))
    }

    /// Set every logit the grammar rules out to −∞; returns whether any token is allowed.
    pub fn mask(&self, logits: &mut [f32]) -> Result<bool> {
        let mut allowed = vec![false; logits.len()];
        self.lock().allowed(&mut allowed)?;
        let mut any = false;
        for (l, &a) in logits.iter_mut().zip(&allowed) {
            if a {
                any = true;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(any)
    }

    pub fn commit(&self, token: u32) -> Result<()> {
        self.lock().commit(token)
    }

    pub fn finished(&self) -> bool {
        self.lock().finished()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, dyn Constraint + 'static> {
        // A panic while holding the lock leaves the grammar state unknown; the request is failing anyway.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for SharedConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedConstraint")
    }
}
