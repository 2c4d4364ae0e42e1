//! The route: what the user asked for ([`SpecMode`]) resolved against what the bundle offers ([`plan`]), and
//! the proposer that decodes it ([`build`]). The one place a route is decided, fallbacks included.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use super::chooser::Chooser;
use super::copy::SuffixCopy;
use super::draft_model::DraftModel;
use super::drafter::DrafterProposer;
use super::mtp::MtpProposer;
use super::Proposer;
use crate::backend::Backend;
use crate::bundle::{Bundle, DrafterStatus, MtpStatus};
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::model::{BlockDrafter, Model, MtpHead};

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
    /// The bundle's block drafter (`drafter/`).
    Drafter,
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
            "drafter" => SpecMode::Drafter,
            "draft-model" => SpecMode::DraftModel(None),
            _ => match s.strip_prefix("draft-model=") {
                Some(p) if !p.is_empty() => SpecMode::DraftModel(Some(PathBuf::from(p))),
                _ => {
                    return Err(Error::Invalid(format!(
                    "speculation {s:?}: expected auto, off, copy, mtp, drafter or draft-model=PATH"
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
    Drafter,
    /// The block drafter and the MTP head, competing cycle by cycle.
    DrafterAndMtp,
    DraftModel(PathBuf),
}

impl Route {
    pub fn name(&self) -> &'static str {
        match self {
            Route::Ar => "ar",
            Route::Copy => "copy",
            Route::Mtp => "mtp",
            Route::Drafter => "drafter",
            Route::DrafterAndMtp => "drafter+mtp",
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

/// Resolve a mode against what the bundle offers. `off` always wins; `auto` takes a complete block drafter and
/// a complete native MTP head together (the chooser measures which drafts better), else the one that is
/// complete, else copying from the prompt; an explicit `mtp` or `drafter` on a bundle without a complete one is
/// an error that says why.
pub fn plan(bundle: &Bundle, mode: &SpecMode) -> Result<Plan> {
    let head = match &bundle.mtp {
        MtpStatus::Complete(_) => Ok(()),
        other => Err(other.describe()),
    };
    let drafter = match &bundle.drafter {
        DrafterStatus::Complete(_) => Ok(()),
        other => Err(other.describe()),
    };
    let drafter_plan = |asked: &str| {
        Plan {
        route: Route::Drafter,
        reason: format!(
            "{asked}: {}; where the context has a copy match, copying or the drafter drafts, whichever has \
             yielded more tokens per second",
            bundle.drafter.describe()
        ),
    }
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
                reason: format!(
                    "MTP requested: {}; where the context has a copy match, copying or the head drafts, whichever \
                     has yielded more tokens per second",
                    bundle.mtp.describe()
                ),
            },
            Err(why) => {
                return Err(Error::Invalid(format!(
                    "the mtp route needs a complete MTP head; this bundle has {why}"
                )))
            }
        },
        SpecMode::Drafter => match drafter {
            Ok(()) => drafter_plan("drafter requested"),
            Err(why) => {
                return Err(Error::Invalid(format!(
                    "the drafter route needs a complete block drafter; this bundle has {why}"
                )))
            }
        },
        SpecMode::Auto if drafter.is_ok() && head.is_ok() => Plan {
            route: Route::DrafterAndMtp,
            reason: format!(
                "auto: {} and {}; each cycle the one that has yielded more tokens per second drafts, copying \
                 competing where the context has a match",
                bundle.drafter.describe(),
                bundle.mtp.describe()
            ),
        },
        SpecMode::Auto if drafter.is_ok() => drafter_plan("auto"),
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
                reason: format!(
                    "native MTP: {}; where the context has a copy match, copying or the head drafts, whichever \
                     has yielded more tokens per second",
                    bundle.mtp.describe()
                ),
            },
            Err(why) => Plan {
                route: Route::Copy,
                reason: format!(
                    "MTP head: {why}; block drafter: {}: copy from the prompt (the controller falls back to AR \
                     where copying does not pay)",
                    bundle.drafter.describe()
                ),
            },
        },
    })
}

/// The proposer for the route `mode` resolves to on `bundle` (loaded as `model` with `tokenizer`), and the plan
/// it decodes by. `None`: plain AR. Under `auto`, a head that looked complete but does not load falls back to
/// copying (the plan says why); an explicit request fails with the reason instead.
pub fn build<B: Backend>(
    bundle: &Bundle,
    model: &Model<B>,
    tokenizer: &Tokenizer,
    backend: Arc<B>,
    mode: &SpecMode,
) -> Result<(Plan, Option<Box<dyn Proposer>>)> {
    let plan = plan(bundle, mode)?;
    let proposer: Box<dyn Proposer> = match &plan.route {
        Route::Ar => return Ok((plan, None)),
        Route::Copy => Box::new(SuffixCopy::new()),
        Route::Mtp => match MtpHead::load(bundle, model) {
            Ok(head) => {
                let head = MtpProposer::new(head, model.hp.vocab, model.hp.context_len)?;
                // Copying competes with the head wherever the context has a match (the chooser).
                Box::new(Chooser::new(vec![Box::new(head)], model.hp.hidden))
            }
            Err(e) if *mode == SpecMode::Auto => {
                tracing::warn!("MTP head unusable, copying instead: {e}");
                let plan = Plan {
                    route: Route::Copy,
                    reason: format!("MTP head unusable ({e}): copy from the prompt"),
                };
                return Ok((plan, Some(Box::new(SuffixCopy::new()))));
            }
            Err(e) => return Err(e),
        },
        Route::Drafter => match BlockDrafter::load(bundle, model) {
            Ok(drafter) => {
                let drafter = DrafterProposer::new(drafter, model.hp.vocab, model.hp.context_len)?;
                Box::new(Chooser::new(vec![Box::new(drafter)], model.hp.hidden))
            }
            Err(e) if *mode == SpecMode::Auto => {
                tracing::warn!("block drafter unusable: {e}");
                let plan = Plan {
                    route: Route::Copy,
                    reason: format!("block drafter unusable ({e}): copy from the prompt"),
                };
                return Ok((plan, Some(Box::new(SuffixCopy::new()))));
            }
            Err(e) => return Err(e),
        },
        Route::DrafterAndMtp => {
            let drafter = BlockDrafter::load(bundle, model).and_then(|d| {
                Ok(Box::new(DrafterProposer::new(
                    d,
                    model.hp.vocab,
                    model.hp.context_len,
                )?) as Box<dyn Proposer>)
            });
            let head = MtpHead::load(bundle, model).and_then(|h| {
                Ok(
                    Box::new(MtpProposer::new(h, model.hp.vocab, model.hp.context_len)?)
                        as Box<dyn Proposer>,
                )
            });
            // Only `auto` plans both: one that does not load leaves the other (the plan says so).
            let (models, plan) = match (drafter, head) {
                (Ok(d), Ok(h)) => (vec![d, h], plan),
                (Ok(d), Err(e)) | (Err(e), Ok(d)) => {
                    tracing::warn!("a speculative model is unusable: {e}");
                    let route = if d.features().final_state {
                        Route::Mtp
                    } else {
                        Route::Drafter
                    };
                    let plan = Plan {
                        reason: format!("{} alone: the other is unusable ({e})", route.name()),
                        route,
                    };
                    (vec![d], plan)
                }
                (Err(e), Err(_)) => {
                    tracing::warn!("block drafter and MTP head unusable: {e}");
                    let plan = Plan {
                        route: Route::Copy,
                        reason: format!(
                            "block drafter and MTP head unusable ({e}): copy from the prompt"
                        ),
                    };
                    return Ok((plan, Some(Box::new(SuffixCopy::new()))));
                }
            };
            let name = plan.route.name();
            let chooser = Chooser::new(models, model.hp.hidden).named(name);
            return Ok((plan, Some(Box::new(chooser))));
        }
        Route::DraftModel(p) => {
            let draft_bundle = Bundle::open(p)?;
            let draft_tok = Tokenizer::from_bundle(&draft_bundle)?;
            if draft_tok.vocab_size() != tokenizer.vocab_size() {
                return Err(Error::Invalid(format!(
                    "draft model {} has another tokenizer ({} tokens, the target has {})",
                    p.display(),
                    draft_tok.vocab_size(),
                    tokenizer.vocab_size()
                )));
            }
            let draft = Model::load(&draft_bundle, backend)?;
            Box::new(DraftModel::new(draft, model.hp.vocab, None)?)
        }
    };
    Ok((plan, Some(proposer)))
}
