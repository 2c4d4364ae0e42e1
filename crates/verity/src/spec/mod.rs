//! Lossless speculative decoding: propose → verify in one W-row forward → accept → commit.
//!
//! Invariants every route keeps:
//! - **Greedy is exact.** The verify forward is row-exact (each row's logits are bitwise the 1-row AR step's),
//!   the verifier takes the target's own choice at every position, and the cache keeps only the verified path;
//!   so the emitted tokens and the cache contents equal those of AR decoding, byte for byte.
//! - **Sampling is lossless.** Drafts are accepted by rejection sampling against the processed target
//!   distribution (see [`verify`]), so every emitted token has the AR sampler's distribution.
//! - **Commit or roll back everything.** After each cycle the target cache and every proposer's state are
//!   truncated to the kept path; nothing of a rejected draft survives.
//!
//! The decode loop ([`crate::engine`]) knows proposers only through [`Proposer`]; the [`Controller`] picks each
//! cycle's width from measured costs and learned acceptance.

pub mod controller;
pub mod copy;
pub mod draft_model;
pub mod mtp;
pub mod proposer;
pub mod verify;

use std::path::PathBuf;
use std::str::FromStr;

pub use controller::Controller;
pub use proposer::{Draft, Proposer};
pub use verify::{Verdict, Verifier};

use crate::bundle::{Bundle, MtpStatus};
use crate::error::{Error, Result};

/// What the user asked for (`--speculation`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecMode {
    /// The fastest route the bundle offers.
    Auto,
    /// Plain autoregressive decoding; disables every speculative route.
    Off,
    Copy,
    /// The bundle's native multi-token-prediction head.
    Mtp,
    /// A separate draft model with the same tokenizer.
    DraftModel(Option<PathBuf>),
}

impl FromStr for SpecMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => SpecMode::Auto,
            "off" | "ar" | "none" => SpecMode::Off,
            "copy" => SpecMode::Copy,
            "mtp" => SpecMode::Mtp,
            "draft-model" => SpecMode::DraftModel(None),
            _ => match s.strip_prefix("draft-model=") {
                Some(p) if !p.is_empty() => SpecMode::DraftModel(Some(PathBuf::from(p))),
                _ => {
                    return Err(Error::Invalid(format!(
                        "speculation {s:?}: expected auto, off, copy, mtp or draft-model=PATH"
                    )))
                }
            },
        })
    }
}

/// The route a request decodes with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Ar,
    Copy,
    Mtp,
    DraftModel(PathBuf),
}

impl Route {
    pub fn name(&self) -> &'static str {
        match self {
            Route::Ar => "ar",
            Route::Copy => "copy",
            Route::Mtp => "mtp",
            Route::DraftModel(_) => "draft_model",
        }
    }
}

/// The chosen route and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub route: Route,
    pub reason: String,
}

/// Resolve a mode against what the bundle offers. `off` always wins; `auto` takes a complete native MTP head,
/// else copying from the prompt; an explicit `mtp` on a bundle without a complete head is an error that says why.
pub fn plan(bundle: &Bundle, mode: &SpecMode) -> Result<Plan> {
    let head = match &bundle.mtp {
        MtpStatus::Complete(_) => Ok(()),
        other => Err(other.describe()),
    };
    Ok(match mode {
        SpecMode::Off => Plan {
            route: Route::Ar,
            reason: "speculation off".into(),
        },
        SpecMode::Copy => Plan {
            route: Route::Copy,
            reason: "copy requested".into(),
        },
        SpecMode::Mtp => match head {
            Ok(()) => Plan {
                route: Route::Mtp,
                reason: format!("MTP requested: {}", bundle.mtp.describe()),
            },
            Err(why) => {
                return Err(Error::Invalid(format!(
                    "the mtp route needs a complete MTP head; this bundle has {why}"
                )))
            }
        },
        SpecMode::DraftModel(Some(p)) => Plan {
            route: Route::DraftModel(p.clone()),
            reason: format!("draft model {} requested", p.display()),
        },
        SpecMode::DraftModel(None) => {
            return Err(Error::Invalid("the draft-model route needs a bundle: draft-model=PATH".into()))
        }
        SpecMode::Auto => match head {
            Ok(()) => Plan {
                route: Route::Mtp,
                reason: format!("native MTP: {}", bundle.mtp.describe()),
            },
            Err(why) => Plan {
                route: Route::Copy,
                reason: format!(
                    "MTP head: {why}; no drafter: copy from the prompt (the controller falls back to AR where \
                     copying does not pay)"
                ),
            },
        },
    })
}
