//! Native multi-token-prediction (MTP) heads: recognising one from the tensors a bundle physically carries.
//!
//! Two public layouts are recognised, by tensor names, never by a model's name:
//! - **Qwen3-Next style**: `mtp.fc` (or the split `mtp.fc_embedding` + `mtp.fc_hidden`, or `mtp.input_proj`),
//!   `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, compute blocks `mtp.layers.N.*`, `mtp.norm`.
//! - **DeepSeek-V3 style**: the head is decoder layer `L ≥ num_hidden_layers` (`num_nextn_predict_layers` of
//!   them): `model.layers.L.{eh_proj, enorm, hnorm, shared_head.norm}` plus the layer's own compute tensors.
//!
//! Heads are looked for in the main shards — including tensors a shard holds but its index omits — and, for a
//! bundle folder, in a side file [`SIDE_FILE`] beside the target's weights (how verity ships a trained head for
//! a GGUF model).
//!
//! Invariants:
//! - Only physically present tensors count (see [`super::safetensors`]): names from shard headers whose byte
//!   ranges lie inside the file. Config keys alone never make a head.
//! - A head is [`MtpStatus::Complete`] only with a fusion projection, both pre-fusion norms, a final norm and at
//!   least one compute block; anything less is [`MtpStatus::Incomplete`] with the reason, and the planner takes
//!   the next route. Nothing here writes into the bundle.

use std::collections::BTreeSet;
use std::path::PathBuf;

/// The side file holding a head for a bundle folder.
pub const SIDE_FILE: &str = "mtp.safetensors";

/// Which naming scheme the head follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MtpLayout {
    Qwen3Next,
    DeepSeekV3,
}

/// The projection fusing the normed token embedding with the normed hidden state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fusion {
    /// One `[hidden, 2·hidden]` matrix over `concat(embedding, hidden)`.
    Joint(String),
    /// Two `[hidden, hidden]` matrices whose outputs are added.
    Split { embedding: String, hidden: String },
}

/// Where a complete head's tensors are and what they are called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MtpHeadSpec {
    pub layout: MtpLayout,
    /// `Some` when the head lives in a side file rather than the main shards.
    pub side_file: Option<PathBuf>,
    pub fusion: Fusion,
    pub embedding_norm: String,
    pub hidden_norm: String,
    pub final_norm: String,
    /// Name prefixes of the compute blocks, e.g. `mtp.layers.0.` (each ends with a dot).
    pub blocks: Vec<String>,
    /// An optional `[V']` list of token ids the head drafts from (a frequency-ranked subset of the vocabulary).
    pub draft_vocab: Option<String>,
}

impl MtpHeadSpec {
    /// Whether a tensor belongs to this head.
    pub fn owns(&self, name: &str) -> bool {
        let fused = match &self.fusion {
            Fusion::Joint(f) => name == f,
            Fusion::Split { embedding, hidden } => name == embedding || name == hidden,
        };
        fused
            || name == self.embedding_norm
            || name == self.hidden_norm
            || name == self.final_norm
            || self.draft_vocab.as_deref() == Some(name)
            || self.blocks.iter().any(|b| name.starts_with(b.as_str()))
    }
}

/// What a bundle offers for native MTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MtpStatus {
    /// No MTP tensor is present (config keys alone do not count).
    Absent,
    /// Some MTP tensors are present but they do not make a usable head.
    Incomplete(String),
    Complete(MtpHeadSpec),
}

impl MtpStatus {
    pub fn describe(&self) -> String {
        match self {
            MtpStatus::Absent => "none".into(),
            MtpStatus::Incomplete(r) => format!("incomplete ({r})"),
            MtpStatus::Complete(s) => format!(
                "{:?} head, {} block(s){}{}",
                s.layout,
                s.blocks.len(),
                s.side_file
                    .as_ref()
                    .map(|p| format!(", in {}", p.display()))
                    .unwrap_or_default(),
                if s.draft_vocab.is_some() {
                    ", with a draft vocabulary"
                } else {
                    ""
                }
            ),
        }
    }
}

/// Name components that make a compute block: attention, a sequence mixer, an MLP or experts.
const COMPUTE: &[&str] = &[
    "self_attn",
    "attn",
    "attention",
    "linear_attn",
    "mixer",
    "mlp",
    "experts",
    "feed_forward",
];

fn is_compute(rest: &str) -> bool {
    rest.split('.').any(|c| COMPUTE.contains(&c))
}

/// Inspect a tensor directory (every physically present name) for a head. `main_layers` is the target's layer
/// count (DeepSeek-style heads are the layers after it) and `nextn` the configured head count, if any.
pub fn inspect<'a>(
    names: impl IntoIterator<Item = &'a str>,
    main_layers: usize,
    nextn: Option<usize>,
) -> MtpStatus {
    let names: BTreeSet<&str> = names.into_iter().collect();
    let qwen: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.starts_with("mtp."))
        .collect();
    if !qwen.is_empty() {
        return inspect_qwen3_next(&names, &qwen);
    }
    inspect_deepseek(&names, main_layers, nextn)
}

fn inspect_qwen3_next(names: &BTreeSet<&str>, mtp: &[&str]) -> MtpStatus {
    let has = |n: &str| names.contains(n);
    let fusion = if has("mtp.fc.weight") {
        Some(Fusion::Joint("mtp.fc.weight".into()))
    } else if has("mtp.input_proj.weight") {
        Some(Fusion::Joint("mtp.input_proj.weight".into()))
    } else if has("mtp.fc_embedding.weight") && has("mtp.fc_hidden.weight") {
        Some(Fusion::Split {
            embedding: "mtp.fc_embedding.weight".into(),
            hidden: "mtp.fc_hidden.weight".into(),
        })
    } else {
        None
    };
    let mut blocks = BTreeSet::new();
    for n in mtp {
        let Some(rest) = n.strip_prefix("mtp.layers.") else {
            continue;
        };
        let Some((idx, tail)) = rest.split_once('.') else {
            continue;
        };
        if let Ok(i) = idx.parse::<usize>() {
            if is_compute(tail) {
                blocks.insert(i);
            }
        }
    }
    let blocks: Vec<String> = blocks
        .into_iter()
        .map(|i| format!("mtp.layers.{i}."))
        .collect();
    finish(
        names,
        MtpLayout::Qwen3Next,
        fusion,
        blocks,
        [
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
        ],
        "mtp.draft_vocab",
    )
}

fn inspect_deepseek(names: &BTreeSet<&str>, main_layers: usize, nextn: Option<usize>) -> MtpStatus {
    // Head layers are those at or after `main_layers` that carry any head-specific tensor.
    let head_parts = ["eh_proj", "enorm", "hnorm", "shared_head"];
    let mut layers = BTreeSet::new();
    for n in names {
        let Some(rest) = n.strip_prefix("model.layers.") else {
            continue;
        };
        let Some((idx, tail)) = rest.split_once('.') else {
            continue;
        };
        if let Ok(l) = idx.parse::<usize>() {
            let part = tail.split('.').next().unwrap_or("");
            if l >= main_layers && head_parts.contains(&part) {
                layers.insert(l);
            }
        }
    }
    let Some(&first) = layers.first() else {
        return MtpStatus::Absent;
    };
    if let Some(n) = nextn {
        if n == 0 {
            return MtpStatus::Incomplete(
                "head tensors are present but num_nextn_predict_layers is 0".into(),
            );
        }
    }
    let p = format!("model.layers.{first}.");
    let fusion = names
        .contains(format!("{p}eh_proj.weight").as_str())
        .then(|| Fusion::Joint(format!("{p}eh_proj.weight")));
    let has_compute = names
        .iter()
        .any(|n| n.strip_prefix(p.as_str()).is_some_and(is_compute));
    let blocks = if has_compute { vec![p.clone()] } else { vec![] };
    finish(
        names,
        MtpLayout::DeepSeekV3,
        fusion,
        blocks,
        [
            &format!("{p}enorm.weight"),
            &format!("{p}hnorm.weight"),
            &format!("{p}shared_head.norm.weight"),
        ],
        "",
    )
}

fn finish(
    names: &BTreeSet<&str>,
    layout: MtpLayout,
    fusion: Option<Fusion>,
    blocks: Vec<String>,
    [emb, hid, fin]: [&str; 3],
    draft_vocab: &str,
) -> MtpStatus {
    let Some(fusion) = fusion else {
        return MtpStatus::Incomplete("no fusion projection".into());
    };
    if blocks.is_empty() {
        return MtpStatus::Incomplete("no compute block".into());
    }
    for n in [emb, hid, fin] {
        if !names.contains(n) {
            return MtpStatus::Incomplete(format!("{n} is missing"));
        }
    }
    MtpStatus::Complete(MtpHeadSpec {
        layout,
        side_file: None,
        fusion,
        embedding_norm: emb.into(),
        hidden_norm: hid.into(),
        final_norm: fin.into(),
        blocks,
        draft_vocab: (!draft_vocab.is_empty() && names.contains(draft_vocab))
            .then(|| draft_vocab.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: &[&str] = &[
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];

    fn qwen_head() -> Vec<String> {
        let mut v: Vec<String> = [
            "mtp.fc.weight",
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(BLOCK.iter().map(|b| format!("mtp.layers.0.{b}")));
        v
    }

    fn run(names: &[String], main: usize, nextn: Option<usize>) -> MtpStatus {
        inspect(names.iter().map(String::as_str), main, nextn)
    }

    #[test]
    fn a_full_qwen3_next_head_is_complete() {
        let MtpStatus::Complete(s) = run(&qwen_head(), 2, Some(1)) else {
            panic!()
        };
        assert_eq!(s.blocks, ["mtp.layers.0."]);
        assert!(s.owns("mtp.layers.0.mlp.up_proj.weight") && !s.owns("model.norm.weight"));
    }

    #[test]
    fn a_stray_fc_alone_is_incomplete() {
        let names = vec!["mtp.fc.weight".to_string()];
        assert_eq!(
            run(&names, 2, Some(1)),
            MtpStatus::Incomplete("no compute block".into())
        );
    }

    #[test]
    fn blocks_without_a_fusion_projection_are_incomplete() {
        let names: Vec<String> = qwen_head()
            .into_iter()
            .filter(|n| n != "mtp.fc.weight")
            .collect();
        assert_eq!(
            run(&names, 2, Some(1)),
            MtpStatus::Incomplete("no fusion projection".into())
        );
    }

    #[test]
    fn half_a_split_fusion_is_not_a_fusion() {
        let mut names: Vec<String> = qwen_head()
            .into_iter()
            .filter(|n| n != "mtp.fc.weight")
            .collect();
        names.push("mtp.fc_hidden.weight".into());
        assert!(matches!(run(&names, 2, None), MtpStatus::Incomplete(_)));
        names.push("mtp.fc_embedding.weight".into());
        assert!(matches!(run(&names, 2, None), MtpStatus::Complete(_)));
    }

    #[test]
    fn config_keys_without_tensors_are_absent() {
        assert_eq!(run(&[], 2, Some(3)), MtpStatus::Absent);
        let main: Vec<String> = BLOCK
            .iter()
            .map(|b| format!("model.layers.1.{b}"))
            .collect();
        assert_eq!(run(&main, 2, Some(1)), MtpStatus::Absent);
    }

    #[test]
    fn a_deepseek_head_is_the_layer_after_the_main_stack() {
        let mut names: Vec<String> = ["eh_proj", "enorm", "hnorm", "shared_head.norm"]
            .iter()
            .map(|p| format!("model.layers.2.{p}.weight"))
            .collect();
        assert_eq!(
            run(&names, 2, Some(1)),
            MtpStatus::Incomplete("no compute block".into())
        );
        names.extend(BLOCK.iter().map(|b| format!("model.layers.2.{b}")));
        let MtpStatus::Complete(s) = run(&names, 2, Some(1)) else {
            panic!()
        };
        assert_eq!(s.layout, MtpLayout::DeepSeekV3);
        assert_eq!(
            s.fusion,
            Fusion::Joint("model.layers.2.eh_proj.weight".into())
        );
        // The same tensors inside the main stack are ordinary layers, not a head.
        assert_eq!(run(&names, 3, Some(1)), MtpStatus::Absent);
    }
}
