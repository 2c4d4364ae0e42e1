//! Presets and the per-tensor type mix: which GGML type each tensor of a model gets.
//!
//! The `_s`/`_m` presets are llama.cpp's mixes (`llama_tensor_get_type` in its `llama-quant.cpp`, without an
//! importance matrix or overrides): the output matrix (or a tied embedding) gets Q6_K, and the `_m` presets give
//! Q6_K to the value projections and FFN down projections of a fixed pattern of layers (`more_bits`). Where a
//! row is not whole blocks of the chosen type, the type falls back to a 32-value format, or to F16 as a last
//! resort, as llama.cpp's does.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// A quantization preset: a default type and, for `_s`/`_m`, a mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    F32,
    F16,
    BF16,
    Q8_0,
    Q6K,
    Q5KM,
    Q5KS,
    Q5_1,
    Q5_0,
    Q4KM,
    Q4KS,
    Q4_1,
    Q4_0,
    Q3KL,
    Q3KM,
    Q3KS,
    Q2K,
}

impl Preset {
    pub const ALL: [Preset; 17] = [
        Preset::Q4KM,
        Preset::Q4KS,
        Preset::Q5KM,
        Preset::Q5KS,
        Preset::Q6K,
        Preset::Q8_0,
        Preset::Q4_0,
        Preset::Q4_1,
        Preset::Q5_0,
        Preset::Q5_1,
        Preset::Q3KL,
        Preset::Q3KM,
        Preset::Q3KS,
        Preset::Q2K,
        Preset::F16,
        Preset::BF16,
        Preset::F32,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::F32 => "f32",
            Preset::F16 => "f16",
            Preset::BF16 => "bf16",
            Preset::Q8_0 => "q8_0",
            Preset::Q6K => "q6_k",
            Preset::Q5KM => "q5_k_m",
            Preset::Q5KS => "q5_k_s",
            Preset::Q5_1 => "q5_1",
            Preset::Q5_0 => "q5_0",
            Preset::Q4KM => "q4_k_m",
            Preset::Q4KS => "q4_k_s",
            Preset::Q4_1 => "q4_1",
            Preset::Q4_0 => "q4_0",
            Preset::Q3KL => "q3_k_l",
            Preset::Q3KM => "q3_k_m",
            Preset::Q3KS => "q3_k_s",
            Preset::Q2K => "q2_k",
        }
    }

    /// The `general.file_type` value llama.cpp writes for this preset (its `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            Preset::F32 => 0,
            Preset::F16 => 1,
            Preset::Q4_0 => 2,
            Preset::Q4_1 => 3,
            Preset::Q8_0 => 7,
            Preset::Q5_0 => 8,
            Preset::Q5_1 => 9,
            Preset::Q2K => 10,
            Preset::Q3KS => 11,
            Preset::Q3KM => 12,
            Preset::Q3KL => 13,
            Preset::Q4KS => 14,
            Preset::Q4KM => 15,
            Preset::Q5KS => 16,
            Preset::Q5KM => 17,
            Preset::Q6K => 18,
            Preset::BF16 => 32,
        }
    }

    /// The type of every quantizable tensor the mix does not single out.
    pub fn default_type(self) -> GgmlType {
        match self {
            Preset::F32 => GgmlType::F32,
            Preset::F16 => GgmlType::F16,
            Preset::BF16 => GgmlType::BF16,
            Preset::Q8_0 => GgmlType::Q8_0,
            Preset::Q6K => GgmlType::Q6K,
            Preset::Q5KM | Preset::Q5KS => GgmlType::Q5K,
            Preset::Q5_1 => GgmlType::Q5_1,
            Preset::Q5_0 => GgmlType::Q5_0,
            Preset::Q4KM | Preset::Q4KS => GgmlType::Q4K,
            Preset::Q4_1 => GgmlType::Q4_1,
            Preset::Q4_0 => GgmlType::Q4_0,
            Preset::Q3KL | Preset::Q3KM | Preset::Q3KS => GgmlType::Q3K,
            Preset::Q2K => GgmlType::Q2K,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == lower)
            .ok_or_else(|| {
                let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
                Error::Invalid(format!(
                    "unknown quantization type {s:?} (one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// What the mix needs to know about the model.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub arch: String,
    pub layers: usize,
    pub experts: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// No `output.weight`: the embedding doubles as the output matrix.
    pub tied_embeddings: bool,
    /// The number of value projections (`attn_v`, fused `attn_qkv`, `attn_kv_b`).
    pub value_projections: usize,
}

impl ModelFacts {
    /// Query heads per key-value head (llama.cpp's `n_gqa`; 0 when the model names no KV heads).
    fn gqa(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(0)
    }

    /// The 70B-class Llama/Qwen2 shapes, whose value projections llama.cpp gives more bits.
    fn is_70b(&self) -> bool {
        self.layers == 80
            && match self.arch.as_str() {
                "llama" => self.experts != 8 && self.heads != self.kv_heads,
                "qwen2" => true,
                _ => false,
            }
    }
}

/// The role of a tensor, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Output,
    TokenEmbedding,
    Value,
    Key,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn role(name: &str) -> Role {
    if name == "output.weight" {
        Role::Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        Role::TokenEmbedding
    } else if name.contains("attn_qkv.weight")
        || name.contains("attn_kv_b.weight")
        || name.contains("attn_v.weight")
    {
        Role::Value
    } else if name.contains("attn_k.weight") {
        Role::Key
    } else if name.contains("attn_output.weight") {
        Role::AttentionOutput
    } else if name.contains("ffn_up") {
        Role::FfnUp
    } else if name.contains("ffn_gate") {
        Role::FfnGate
    } else if name.contains("ffn_down") {
        Role::FfnDown
    } else {
        Role::Other
    }
}

/// Whether a tensor of this name and dimension count is quantized at all (norms, routers, position tables and
/// other small or sensitive tensors keep their type).
pub fn is_quantizable(name: &str, n_dims: usize) -> bool {
    const KEEP: &[&str] = &[
        "_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
        "time_mix_",
        "attn_rel_b.weight",
        ".position_embd",
        "sam.pos_embd",
        "sam.neck.",
        "sam.net_",
        ".rel_pos",
        ".patch_embd",
        ".patch_merger",
        "a.rvq.codebook",
        "mm.a.code_embd",
    ];
    n_dims >= 2
        && name.ends_with("weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
        && !KEEP.iter().any(|k| name.contains(k))
}

/// The layer pattern that gets more bits in the `_m` presets: the first and last eighth, and every third
/// layer between.
fn more_bits(layer: usize, layers: usize) -> bool {
    let (layer, layers) = (layer as i64, layers as i64);
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// Chooses each tensor's type, in the order llama.cpp visits them (the counters of value projections and FFN
/// down projections make the choice depend on the order).
pub struct Mix {
    preset: Preset,
    facts: ModelFacts,
    value_seen: usize,
    down_seen: usize,
}

/// A tensor's chosen type, and why it is not the preset's default where that is worth saying.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub ty: GgmlType,
    pub fallback: Option<String>,
}

impl Mix {
    pub fn new(preset: Preset, facts: ModelFacts) -> Self {
        Mix {
            preset,
            facts,
            value_seen: 0,
            down_seen: 0,
        }
    }

    /// The type of the next tensor (`dims` in GGML order), or its own type where it is not quantized.
    pub fn choose(&mut self, name: &str, dims: &[usize], current: GgmlType) -> Result<Choice> {
        let n_dims = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
        if !is_quantizable(name, n_dims) {
            return Ok(Choice {
                ty: current,
                fallback: None,
            });
        }
        let default = self.preset.default_type();
        if default.is_float() {
            return Ok(Choice {
                ty: default,
                fallback: None,
            });
        }
        let ty = self.mixed(name, dims[0], default)?;
        Ok(fallback(dims[0], ty))
    }

    fn mixed(&mut self, name: &str, cols: usize, default: GgmlType) -> Result<GgmlType> {
        use GgmlType as T;
        use Preset as P;
        let (preset, facts) = (self.preset, &self.facts);
        let falcon = facts.arch == "falcon";
        let role = role(name);
        let mut ty = default;
        if role == Role::Output || (facts.tied_embeddings && role == Role::TokenEmbedding) {
            if falcon || !cols.is_multiple_of(default.block_len()) {
                ty = T::Q8_0;
            } else if ty != T::Q8_0 {
                ty = T::Q6K;
            }
            return Ok(ty);
        }
        match role {
            Role::Value => {
                let i = self.value_seen;
                match preset {
                    P::Q2K => ty = if facts.gqa() >= 4 { T::Q4K } else { T::Q3K },
                    P::Q3KM => ty = if i < 2 { T::Q5K } else { T::Q4K },
                    P::Q3KL => ty = T::Q5K,
                    P::Q4KM | P::Q5KM if more_bits(i, facts.value_projections) => ty = T::Q6K,
                    P::Q4KS if i < 4 => ty = T::Q5K,
                    _ => {}
                }
                if facts.is_70b() && matches!(ty, T::Q3K | T::Q4K) {
                    ty = T::Q5K;
                }
                if facts.experts == 8 {
                    ty = T::Q8_0;
                }
                self.value_seen += 1;
            }
            Role::Key if facts.experts == 8 => ty = T::Q8_0,
            Role::FfnDown => {
                let layer = self.layer_of(name, self.down_seen)?;
                let layers = facts.layers;
                match preset {
                    P::Q2K => ty = T::Q3K,
                    P::Q3KM => {
                        ty = if layer < layers / 16 {
                            T::Q5K
                        } else if !falcon || more_bits(layer, layers) {
                            T::Q4K
                        } else {
                            T::Q3K
                        }
                    }
                    P::Q3KL => ty = if falcon { T::Q4K } else { T::Q5K },
                    P::Q4KM if falcon => {
                        ty = if layer < layers / 16 {
                            T::Q6K
                        } else if more_bits(layer, layers) {
                            T::Q5K
                        } else {
                            T::Q4K
                        }
                    }
                    P::Q4KM | P::Q5KM if more_bits(layer, layers) => ty = T::Q6K,
                    P::Q4KS if !falcon && layer < layers / 8 => ty = T::Q5K,
                    _ => {}
                }
                self.down_seen += 1;
            }
            Role::AttentionOutput => {
                ty = match (falcon, facts.experts == 8, preset) {
                    (true, _, P::Q3KL) => T::Q4K,
                    (false, true, P::Q2K | P::Q3KS | P::Q3KM | P::Q4KS | P::Q4KM) => T::Q5K,
                    (false, false, P::Q2K) => T::Q3K,
                    (false, false, P::Q3KM) => T::Q4K,
                    (false, false, P::Q3KL) => T::Q5K,
                    _ => ty,
                }
            }
            Role::FfnUp | Role::FfnGate if facts.experts > 1 => {
                self.layer_of(name, 0)?;
            }
            _ => {}
        }
        Ok(ty)
    }

    /// The layer of a per-layer tensor: its position among its kind, or for mixtures of experts (whose expert
    /// tensors need not come in layer order) the number in its name.
    fn layer_of(&self, name: &str, seen: usize) -> Result<usize> {
        if self.facts.experts <= 1 {
            return Ok(seen);
        }
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| Error::tensor(name, "cannot tell the layer from the name"))?;
        if layer >= self.facts.layers {
            return Err(Error::tensor(
                name,
                format!("layer {layer} of a {}-layer model", self.facts.layers),
            ));
        }
        Ok(layer)
    }
}

/// A type whose blocks do not divide the row falls back to a 32-value format, or to F16.
fn fallback(cols: usize, ty: GgmlType) -> Choice {
    use GgmlType as T;
    if cols.is_multiple_of(ty.block_len()) {
        return Choice { ty, fallback: None };
    }
    let to = match ty {
        T::Q4K => T::Q5_0,
        T::Q5K => T::Q5_1,
        T::Q6K => T::Q8_0,
        T::Q2K | T::Q3K => T::Q4_0,
        T::IQ4XS => T::IQ4NL,
        other => other,
    };
    let to = if cols.is_multiple_of(to.block_len()) {
        to
    } else {
        T::F16
    };
    Choice {
        ty: to,
        fallback: Some(format!(
            "rows of {cols} are not whole {} blocks: {}",
            ty.name(),
            to.name()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_by_name_in_any_case() {
        for p in Preset::ALL {
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
        assert_eq!("Q4_K_M".parse::<Preset>().unwrap(), Preset::Q4KM);
        let e = "q3_k".parse::<Preset>().unwrap_err().to_string();
        assert!(e.contains("q4_k_m"), "{e}");
    }

    #[test]
    fn the_more_bits_layers_of_a_32_layer_model() {
        let layers: Vec<_> = (0..32).filter(|&l| more_bits(l, 32)).collect();
        assert_eq!(
            layers,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back() {
        assert_eq!(fallback(640, GgmlType::Q4K).ty, GgmlType::Q5_0);
        assert_eq!(fallback(640, GgmlType::Q6K).ty, GgmlType::Q8_0);
        assert_eq!(fallback(48, GgmlType::Q4K).ty, GgmlType::F16);
        assert_eq!(fallback(48, GgmlType::Q8_0).ty, GgmlType::F16);
        assert_eq!(fallback(512, GgmlType::Q4K).fallback, None);
    }

    #[test]
    fn norms_and_vectors_keep_their_type() {
        assert!(!is_quantizable("blk.0.attn_norm.weight", 1));
        assert!(!is_quantizable("blk.0.ffn_gate_inp.weight", 2));
        assert!(!is_quantizable("blk.0.attn_q.bias", 2));
        assert!(is_quantizable("blk.0.attn_q.weight", 2));
    }
}
