//! A bundled block drafter (DFlash-style): a folder [`FOLDER`] inside a bundle folder, holding `config.json`
//! and the drafter's safetensors, in the layout of published DFlash drafters.
//!
//! The config is a Qwen3/Llama decoder config (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
//! `num_key_value_heads`, `head_dim`, `intermediate_size`, `rms_norm_eps`, `rope_theta`, `vocab_size`) plus
//! `dflash_config: {target_layer_ids, block_size, mask_token_id}` (the three are also read at the top level).
//! The tensors: `fc.weight` `[hidden, n·hidden]` (the fusion of the `n` target layers' hidden states),
//! `hidden_norm.weight`, `norm.weight`, and per layer `layers.L.input_layernorm`, `layers.L.self_attn.{q,k,v,o}_proj`
//! (with `q_norm`/`k_norm` where present), `layers.L.post_attention_layernorm` and `layers.L.mlp.{gate,up,down}_proj`;
//! optionally [`DRAFT_VOCAB`], a 1-D I32 list of the token ids the drafter drafts from (a frequency-ranked subset
//! of the vocabulary: its output matrix is restricted to them, as an MTP head's may be).
//!
//! Invariants (the discipline of the MTP heads): a drafter is [`DrafterStatus::Complete`] only when its config
//! fits the target (hidden size, vocabulary, layer ids inside the target, mask token inside the vocabulary) and
//! every tensor it needs is physically present with its exact shape; anything less is
//! [`DrafterStatus::Incomplete`] with the reason, and the planner takes the next route. Variants this runtime
//! does not implement (a scaled input embedding, a logit multiplier or softcap, causal or sliding-window
//! drafter layers, DFlash 2's convolutions) are refused by name, never run approximately.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::hparams::HParams;
use super::safetensors::SafetensorsSet;
use super::TensorKey;

/// The drafter's folder inside a bundle folder.
pub const FOLDER: &str = "drafter";
/// The longest block a drafter may propose (the pending token and up to 15 drafts).
pub const MAX_BLOCK: usize = 16;
/// The optional tensor listing the token ids a drafter drafts from.
pub const DRAFT_VOCAB: &str = "draft_vocab";

/// A complete drafter: its shapes and what it reads from the target.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterSpec {
    pub dir: PathBuf,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Per-head RMS norms of Q and K (Qwen3-style drafter layers).
    pub qk_norm: bool,
    /// The target layers whose outputs (the residual stream after each) are fused into the drafter's context.
    pub target_layers: Vec<usize>,
    /// Tokens per block: the pending token and `block - 1` drafts.
    pub block: usize,
    /// The token the block's undrafted positions hold.
    pub mask_token: u32,
    /// Whether the drafter drafts from a subset of the vocabulary ([`DRAFT_VOCAB`]).
    pub draft_vocab: bool,
}

/// What a bundle offers as a block drafter.
#[derive(Debug, Clone, PartialEq)]
pub enum DrafterStatus {
    Absent,
    Incomplete(String),
    Complete(Box<DrafterSpec>),
}

impl DrafterStatus {
    pub fn describe(&self) -> String {
        match self {
            DrafterStatus::Absent => "none".into(),
            DrafterStatus::Incomplete(r) => format!("incomplete ({r})"),
            DrafterStatus::Complete(s) => format!(
                "block drafter, {} layer(s), blocks of {}, reading target layers {:?}{}",
                s.layers,
                s.block,
                s.target_layers,
                if s.draft_vocab {
                    ", with a draft vocabulary"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The DFlash fields, read from `dflash_config` first and then from the top level (as DFlash reads them).
#[derive(Debug, Default, Deserialize)]
struct DflashFields {
    target_layer_ids: Option<Vec<usize>>,
    block_size: Option<usize>,
    mask_token_id: Option<u32>,
    input_embedding_scale: Option<f32>,
    output_multiplier: Option<f32>,
    final_logit_softcapping: Option<f32>,
    conv_kernel_size: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct DrafterConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: usize,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    vocab_size: Option<usize>,
    #[serde(default)]
    dflash_config: DflashFields,
    #[serde(flatten)]
    top: DflashFields,
    is_causal: Option<bool>,
    layer_types: Option<Vec<String>>,
}

/// Inspect `dir/drafter` against the target: the status, and a complete drafter's tensors.
pub fn inspect(bundle_dir: &Path, target: &HParams) -> (DrafterStatus, Option<SafetensorsSet>) {
    let dir = bundle_dir.join(FOLDER);
    if !dir.is_dir() {
        return (DrafterStatus::Absent, None);
    }
    match check(&dir, target) {
        Ok((spec, set)) => (DrafterStatus::Complete(Box::new(spec)), Some(set)),
        Err(why) => (DrafterStatus::Incomplete(why), None),
    }
}

fn check(dir: &Path, t: &HParams) -> Result<(DrafterSpec, SafetensorsSet), String> {
    let cfg_path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let c: DrafterConfig = serde_json::from_str(&text)
        .map_err(|e| format!("{}: invalid drafter config: {e}", cfg_path.display()))?;
    let (d, top) = (&c.dflash_config, &c.top);
    let target_layers = (d.target_layer_ids.clone())
        .or_else(|| top.target_layer_ids.clone())
        .ok_or("no target_layer_ids")?;
    let block = d.block_size.or(top.block_size).unwrap_or(MAX_BLOCK);
    let mask_token = d
        .mask_token_id
        .or(top.mask_token_id)
        .ok_or("no mask_token_id")?;

    for (what, v) in [
        (
            "input_embedding_scale",
            d.input_embedding_scale.or(top.input_embedding_scale),
        ),
        (
            "output_multiplier",
            d.output_multiplier.or(top.output_multiplier),
        ),
    ] {
        if v.is_some_and(|v| v != 1.0) {
            return Err(format!("{what} {v:?} is not supported"));
        }
    }
    let softcap = d.final_logit_softcapping.or(top.final_logit_softcapping);
    if softcap.is_some_and(|v| v > 0.0) {
        return Err("a logit softcap is not supported".into());
    }
    if c.is_causal == Some(true)
        || c.layer_types
            .as_ref()
            .is_some_and(|l| l.iter().any(|t| t != "full_attention"))
    {
        return Err("causal or sliding-window drafter layers are not supported".into());
    }
    if d.conv_kernel_size.or(top.conv_kernel_size).is_some() {
        return Err("DFlash 2 convolutions are not supported".into());
    }
    if c.hidden_size != t.hidden {
        return Err(format!(
            "hidden size {} but the target's is {}",
            c.hidden_size, t.hidden
        ));
    }
    if let Some(v) = c.vocab_size.filter(|&v| v != t.vocab) {
        return Err(format!("vocabulary {v} but the target's is {}", t.vocab));
    }
    if target_layers.is_empty() || target_layers.len() > crate::model::MAX_STATE_LAYERS {
        return Err(format!(
            "{} target layers (1 to {})",
            target_layers.len(),
            crate::model::MAX_STATE_LAYERS
        ));
    }
    let mut sorted = target_layers.clone();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != target_layers.len() || sorted[sorted.len() - 1] >= t.n_layers {
        return Err(format!(
            "target layers {target_layers:?} are not distinct layers of a {}-layer target",
            t.n_layers
        ));
    }
    if !(2..=MAX_BLOCK).contains(&block) {
        return Err(format!("block size {block} (2 to {MAX_BLOCK})"));
    }
    if mask_token as usize >= t.vocab {
        return Err(format!(
            "mask token {mask_token} outside the {}-token vocabulary",
            t.vocab
        ));
    }
    let heads = c.num_attention_heads;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    let head_dim = c.head_dim.unwrap_or(c.hidden_size / heads.max(1));
    if c.num_hidden_layers == 0
        || heads == 0
        || kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || head_dim == 0
        || !head_dim.is_multiple_of(2)
        || c.intermediate_size == 0
    {
        return Err(format!(
            "layers {}, heads {heads}/{kv_heads} × {head_dim}, ffn {}",
            c.num_hidden_layers, c.intermediate_size
        ));
    }

    let set = SafetensorsSet::open(dir).map_err(|e| e.to_string())?;
    let h = t.hidden;
    let (qd, kvd, f) = (heads * head_dim, kv_heads * head_dim, c.intermediate_size);
    let expect = |name: &str, shape: &[usize]| -> Result<(), String> {
        match set.get(name) {
            None => Err(format!("{name}: {}", set.why_missing(name))),
            Some(ts) if ts.shape != shape => {
                Err(format!("{name}: shape {:?}, expected {shape:?}", ts.shape))
            }
            Some(_) => Ok(()),
        }
    };
    expect("fc.weight", &[h, target_layers.len() * h])?;
    expect("hidden_norm.weight", &[h])?;
    expect("norm.weight", &[h])?;
    let qk_norm = set.get("layers.0.self_attn.q_norm.weight").is_some();
    for l in 0..c.num_hidden_layers {
        let mut keys = vec![
            (TensorKey::AttnNorm(l), vec![h]),
            (TensorKey::Q(l), vec![qd, h]),
            (TensorKey::K(l), vec![kvd, h]),
            (TensorKey::V(l), vec![kvd, h]),
            (TensorKey::O(l), vec![h, qd]),
            (TensorKey::FfnNorm(l), vec![h]),
            (TensorKey::Gate(l), vec![f, h]),
            (TensorKey::Up(l), vec![f, h]),
            (TensorKey::Down(l), vec![h, f]),
        ];
        if qk_norm {
            keys.push((TensorKey::QNorm(l), vec![head_dim]));
            keys.push((TensorKey::KNorm(l), vec![head_dim]));
        }
        for (key, shape) in keys {
            expect(&tensor_name(key), &shape)?;
        }
    }
    let draft_vocab = set.get(DRAFT_VOCAB).is_some();
    if draft_vocab {
        let ids = super::st_token_ids(&set, DRAFT_VOCAB, t.vocab).map_err(|e| e.to_string())?;
        if ids.is_empty() {
            return Err(format!("{DRAFT_VOCAB}: empty"));
        }
    }
    let spec = DrafterSpec {
        draft_vocab,
        dir: dir.to_path_buf(),
        layers: c.num_hidden_layers,
        heads,
        kv_heads,
        head_dim,
        ffn: f,
        rms_eps: c.rms_norm_eps.unwrap_or(t.rms_eps),
        rope_theta: c.rope_theta.unwrap_or(t.rope_theta),
        qk_norm,
        target_layers,
        block,
        mask_token,
    };
    Ok((spec, set))
}

/// The drafter's name for a per-layer tensor (`layers.L.self_attn.q_proj.weight`).
pub fn tensor_name(key: TensorKey) -> String {
    format!(
        "layers.{}.{}",
        key.layer().expect("a layer tensor"),
        key.hf_layer_name().expect("a layer tensor")
    )
}
