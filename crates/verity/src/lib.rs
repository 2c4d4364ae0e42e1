//! verity: local LLM inference with lossless speculative decoding.
//!
//! The engine is split by concern: [`bundle`] reads model files, [`quant`] decodes weight formats, [`backend`]
//! runs the operations a forward is made of, [`model`] composes them into architectures, [`cache`] holds model
//! state, [`sample`] turns logits into tokens, [`chat`] handles tokenizers and templates, [`engine`] runs
//! requests, and [`registry`] fetches named models.

pub mod backend;
pub mod bundle;
pub mod cache;
pub mod chat;
pub mod engine;
pub mod error;
pub mod model;
pub mod quant;
pub mod registry;
pub mod sample;
pub mod spec;
pub mod storage;

pub use error::{Error, Result};
