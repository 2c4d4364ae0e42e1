//! verity: local LLM inference with lossless speculative decoding.
//!
//! The engine is split by concern: [`bundle`] reads (and writes) model files, [`quant`] decodes and encodes
//! weight formats, [`quantize`] writes quantized models, [`backend`] runs the operations a forward is made of,
//! [`model`] composes them into architectures, [`cache`] holds model state, [`sample`] turns logits into tokens,
//! [`chat`] handles tokenizers and templates, [`speculative`] drafts and verifies, [`engine`] runs requests, and
//! [`storage`] maps files and finds verity's cache folder. The
//! library never spawns processes or touches the network: fetching named models is `verity-registry`'s job.

pub mod backend;
pub mod bundle;
pub mod cache;
pub mod chat;
pub mod engine;
pub mod error;
pub mod model;
pub mod quant;
pub mod quantize;
pub mod sample;
pub mod speculative;
pub mod storage;
pub mod vision;

pub use error::{Error, Result};
