//! Lossless speculative decoding: propose → verify in one W-row forward → accept → commit.
//!
//! Invariants every route keeps:
//! - **Greedy is exact.** The verify forward is row-exact (each row's logits are bitwise the 1-row AR step's),
//!   the verifier takes the target's own choice at every position, and the cache keeps only the verified path;
//!   so the emitted tokens and the cache contents equal those of AR decoding, byte for byte.
//! - **Sampling is lossless, and a seed fixes the output.** The token at each position is drawn with random
//!   numbers keyed by the request's seed and that absolute position, not by how many draws came before; the
//!   verifier keeps a draft exactly when it is the target's draw there (see [`verify`]). So every route emits, token for
//!   token, what sampled AR emits with the same seed — whatever the proposer drafted, how wide, or what the
//!   controller learned before — the sampled twin of "greedy is exact".
//! - **Commit or roll back everything.** After each cycle the target cache and every proposer's state are
//!   truncated to the kept path; nothing of a rejected draft survives.
//!
//! The decode loop ([`crate::engine`]) knows proposers only through [`Proposer`]; the [`Controller`] picks each
//! cycle's width from measured costs and learned acceptance.

pub mod chooser;
pub mod controller;
pub mod copy;
pub mod draft_model;
pub mod drafter;
pub mod mtp;
pub mod proposer;
mod route;
pub mod verify;

pub use controller::{BatchGate, Controller, RowCost};
pub use proposer::{Begun, Draft, Outcome, Proposer};
pub use route::{build, plan, Plan, Route, SpecMode};
pub use verify::{Verdict, Verifier};
