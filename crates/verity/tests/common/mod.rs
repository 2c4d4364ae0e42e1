//! Shared test helpers: fixture paths, the real model (fetched the way the CLI fetches it), loading.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use verity::backend::cpu::{Activations, CpuBackend};
use verity::bundle::Bundle;
use verity::model::Model;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn hf_bundle(name: &str) -> PathBuf {
    fixtures().join("hf").join(name)
}

pub const HF_BUNDLES: &[&str] = &[
    "llama-f32",
    "llama-bf16",
    "llama-f16-tied",
    "qwen2-f32",
    "qwen3-f32",
    "qwen3-bf16",
    "mlx-llama-q4-g32",
    "mlx-llama-q4-g64",
    "mlx-llama-q8-g128",
];

/// SmolLM2-135M-Instruct Q4_1, fetched into verity's cache on first use (as `verity fetch` does).
pub fn smollm2() -> PathBuf {
    verity::registry::resolve(verity::registry::DEFAULT_MODEL, &mut |_, _| {})
        .expect("fetching smollm2-135m")
}

/// The default backend (8-bit activations for the formats with integer kernels).
pub fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_activations(2, Activations::Q8).expect("cpu backend"))
}

pub fn load_model(path: &Path) -> Model<CpuBackend> {
    load_model_on(path, backend())
}

pub fn load_model_on(path: &Path, be: Arc<CpuBackend>) -> Model<CpuBackend> {
    let bundle = Bundle::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Model::load(&bundle, be).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The f32-activation backend: the accurate path, compared with the references at tight tolerances.
pub fn f32_backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_activations(2, Activations::F32).expect("cpu backend"))
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
