//! Hyper-parameters of a decoder, derived from a GGUF header or a Hugging Face `config.json`.

use serde::Deserialize;

use super::gguf::GgufFile;
use crate::backend::{yarn_mscale, Glu, RopeScaling, RopeStyle};
use crate::error::{Error, Result};

/// The architectures verity implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    /// Qwen3-Next: Gated DeltaNet layers between gated full-attention ones, a mixture with a shared expert.
    Qwen3Next,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3Next => "qwen3next",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_hidden: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// How the rotations are stretched (a model with local layers stretches its global layers' only).
    pub rope_scaling: RopeScaling,
    pub tied_embeddings: bool,
    /// Qwen2: biases on the Q, K and V projections.
    pub qkv_bias: bool,
    /// Qwen3: an RMS norm over each head of Q and K before RoPE.
    pub qk_norm: bool,
    pub context_len: usize,
    /// How the blocks differ from Llama's (all defaults for Llama and Qwen).
    pub block: BlockStyle,
}

/// What sets a decoder's blocks apart from the Llama block: the defaults are Llama's.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStyle {
    /// The gated MLP's activation.
    pub glu: Glu,
    /// Gemma 2/3: the attention and MLP outputs are RMS-normed (their own weights) before the residual add.
    pub post_norms: bool,
    /// Gemma: embeddings are multiplied by this (√hidden) before the first layer.
    pub embedding_scale: Option<f32>,
    /// The attention score scale, where it is not 1/√head_dim (Gemma's `query_pre_attn_scalar`).
    pub attention_scale: Option<f32>,
    /// Local (sliding-window) attention layers, where the model has them.
    pub sliding: Option<SlidingWindow>,
    /// Sparse mixture-of-experts MLPs, where the model has them.
    pub moe: Option<Moe>,
    /// RoPE rotates only the first this many values of each head (Qwen3-Next: a quarter), not all of them.
    pub rotary_dims: Option<usize>,
    /// Qwen3-Next: the Q projection carries a gate per head (`[q_h, gate_h]` for each head h) whose sigmoid
    /// scales the attention output before the output projection.
    pub attention_gate: bool,
    /// Gated DeltaNet (linear attention) layers, where the model has them.
    pub linear: Option<LinearAttention>,
    /// Qwen2.5-VL: multimodal rotary positions; how many of each head's rotated pairs, from the first, turn
    /// with a row's temporal, height and width position ([`crate::backend::Rope::mrope`]).
    pub mrope: Option<[usize; 3]>,
}

/// Gated DeltaNet layers (Qwen3-Next): per value head a `key_dim × value_dim` state updated by the delta rule
/// with a learned decay, fed through a short causal convolution of `conv_kernel` taps over the Q/K/V channels.
/// `value_heads` is a multiple of `key_heads` (each key head serves `value_heads / key_heads` value heads).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttention {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// Per layer: `true` where the layer is a Gated DeltaNet (the others are full attention).
    pub layers: Vec<bool>,
}

impl LinearAttention {
    /// Channels of the convolution: every key head's Q and K, every value head's V.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Values of one layer's recurrent state: the convolution's last `conv_kernel - 1` inputs per channel,
    /// then each value head's `key_dim × value_dim` matrix.
    pub fn state_len(&self) -> usize {
        self.conv_channels() * (self.conv_kernel - 1)
            + self.value_heads * self.key_dim * self.value_dim
    }
}

/// A mixture-of-experts MLP (Qwen3-MoE): a router scores `experts` gated MLPs of `ffn` hidden units per token,
/// the `top_k` best run, and their outputs are summed weighted by the router's softmax (renormalized over the
/// chosen ones when `norm_top_k`).
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    pub ffn: usize,
    pub norm_top_k: bool,
    /// Per layer: whether its MLP is the mixture (the others are dense, of `ffn_hidden` units).
    pub sparse: Vec<bool>,
    /// Qwen3-Next: a shared expert of this many units that every token runs, its output scaled by the sigmoid
    /// of a one-row projection of the token, added to the routed experts'.
    pub shared_ffn: Option<usize>,
}

/// Local attention: a layer marked local attends to the `window` latest positions only (its own included) and
/// rotates by its own RoPE base.
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub rope_theta: f32,
    /// One entry per layer: `true` where the layer is local.
    pub local: Vec<bool>,
}

impl HParams {
    /// The attention score scale of this model.
    pub fn attention_scale(&self) -> f32 {
        self.block
            .attention_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Layer `l`'s attention window (`None`: the whole context) and RoPE base.
    pub fn layer_attention(&self, l: usize) -> (Option<usize>, f32) {
        match &self.block.sliding {
            Some(s) if s.local[l] => (Some(s.window), s.rope_theta),
            _ => (None, self.rope_theta),
        }
    }
}

/// The longest context a header may declare (16M tokens; the longest real models declare 10M): beyond it a
/// value is corrupt, and would size caches from nonsense.
pub const MAX_CONTEXT: usize = 1 << 24;

/// Where a header does not say how long its context is.
const DEFAULT_CONTEXT: usize = 4096;

impl HParams {
    /// Check the relations the forward relies on, so that a bad header fails here and not in a kernel.
    pub fn validate(&self) -> Result<()> {
        self.check()
            .map_err(|m| Error::Invalid(format!("model hyper-parameters: {m}")))
    }

    /// [`HParams::validate`]'s check: what is wrong, if anything.
    fn check(&self) -> std::result::Result<(), String> {
        let bad = Err;
        if self.n_layers == 0
            || self.hidden == 0
            || self.n_heads == 0
            || self.vocab == 0
            || self.ffn_hidden == 0
        {
            return bad(format!("zero size in {self:?}"));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > 1024 {
            return bad(format!("head dimension {}", self.head_dim));
        }
        // Bounds that no real model reaches but that stop absurd headers from driving huge allocations.
        if self.n_layers > 1024
            || self.hidden > 1 << 17
            || self.n_heads > 1024
            || self.vocab > 1 << 24
        {
            return bad(format!("sizes out of range in {self:?}"));
        }
        if let Some(m) = &self.block.moe {
            if m.experts == 0
                || m.experts > 1024
                || m.top_k == 0
                || m.top_k > m.experts
                || m.ffn == 0
            {
                return bad(format!("mixture of experts {m:?}"));
            }
            if m.sparse.len() != self.n_layers {
                return bad(format!(
                    "{} layers but {} sparse flags",
                    self.n_layers,
                    m.sparse.len()
                ));
            }
        }
        if self.block.mrope.is_some() && self.block.sliding.is_some() {
            // A local layer's window is counted in rotary positions, which multimodal ones do not keep.
            return bad("multimodal rotary positions with sliding-window layers".into());
        }
        if let Some(r) = self.block.rotary_dims {
            if r == 0 || !r.is_multiple_of(2) || r > self.head_dim {
                return bad(format!(
                    "{r} rotated values of {}-value heads",
                    self.head_dim
                ));
            }
        }
        if let Some(la) = &self.block.linear {
            let sizes = [la.key_heads, la.value_heads, la.key_dim, la.value_dim];
            if sizes.iter().any(|&x| x == 0 || x > 4096)
                || !la.value_heads.is_multiple_of(la.key_heads)
                || !(1..=16).contains(&la.conv_kernel)
                || la.layers.len() != self.n_layers
            {
                return bad(format!("linear attention {la:?}"));
            }
        }
        // Written so that NaN fails too; an infinite base would make every rotation angle 0 or NaN.
        let in_range = self.rms_eps > 0.0
            && self.rms_eps < 1.0
            && self.rope_theta > 0.0
            && self.rope_theta.is_finite();
        if !in_range {
            return bad(format!(
                "rms_eps {} / rope_theta {}",
                self.rms_eps, self.rope_theta
            ));
        }
        if let Some(s) = &self.block.sliding {
            if s.window == 0
                || s.local.len() != self.n_layers
                || !(s.rope_theta > 0.0 && s.rope_theta.is_finite())
            {
                return bad(format!("sliding window {s:?} for {} layers", self.n_layers));
            }
        }
        if self
            .block
            .attention_scale
            .is_some_and(|a| !(a > 0.0 && a.is_finite()))
            || self
                .block
                .embedding_scale
                .is_some_and(|a| !(a > 0.0 && a.is_finite()))
        {
            return bad(format!("scales in {:?}", self.block));
        }
        if self.context_len == 0 || self.context_len > MAX_CONTEXT {
            return bad(format!(
                "context length {} (expected 1 to {MAX_CONTEXT})",
                self.context_len
            ));
        }
        Ok(())
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Error::malformed(&g.path, "general.architecture is missing"))?
            .to_string();
        let (arch, rope_style) = match arch_name.as_str() {
            "llama" => (Arch::Llama, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::HalfSplit),
            "qwen3" | "qwen3moe" => (Arch::Qwen3, RopeStyle::HalfSplit),
            "gemma3" => (Arch::Gemma3, RopeStyle::HalfSplit),
            "qwen3next" => (Arch::Qwen3Next, RopeStyle::HalfSplit),
            other => {
                return Err(Error::Unsupported(format!(
                "{}: architecture {other:?} (verity runs llama, qwen2, qwen3, qwen3moe, qwen3next, gemma3)",
                g.path.display()
            )))
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let int = |k: &str| -> Result<usize> {
            g.get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| {
                    Error::malformed(&g.path, format!("{} is missing or not an integer", key(k)))
                })
        };
        // Absent: the default; present, a number (or an error: a typo'd type is not a reason to guess).
        let float = |k: &str, default: f64| -> Result<f32> {
            match g.get(&key(k)) {
                None => Ok(default as f32),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    Error::malformed(&g.path, format!("{} is not a number: {v:?}", key(k)))
                }),
            }
        };
        let optional_int = |k: &str| -> Result<Option<usize>> {
            match g.get(&key(k)) {
                None => Ok(None),
                Some(_) => int(k).map(Some),
            }
        };
        let hidden = int("embedding_length")?;
        let n_heads = int("attention.head_count")?;
        let n_kv_heads = int("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim =
            int("attention.key_length").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let vocab = match int("vocab_size") {
            Ok(v) => v,
            Err(_) => g
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| Error::malformed(&g.path, "vocabulary size unknown"))?,
        };
        // Qwen3-Next rotates part of each head; any other architecture whose header says so is another model.
        let rotary_dims = match optional_int("rope.dimension_count")? {
            Some(d) if d == head_dim => None,
            Some(d) if arch == Arch::Qwen3Next => Some(d),
            Some(d) => {
                return Err(Error::malformed(
                    &g.path,
                    format!(
                        "{} is {d} but a head has {head_dim} dimensions (partial rotary embeddings \
                         are a Qwen3-Next feature)",
                        key("rope.dimension_count")
                    ),
                ));
            }
            None => None,
        };
        let rope_theta = float("rope.freq_base", 10000.0)?;
        let rope_scaling = gguf_rope_scaling(g, &key, head_dim, rope_theta)?;
        let tied = g.tensor("output.weight").is_none();
        let n_layers = int("block_count")?;
        let block = match arch {
            Arch::Gemma3 => {
                // What llama.cpp's gemma3 loader fixes rather than reads: every sixth layer global, the local
                // layers' RoPE base 10,000, and queries scaled by 1/√head_dim except in the 27B model (62
                // layers), whose `query_pre_attn_scalar` is hidden/heads.
                let window = int("attention.sliding_window")?;
                let attention_scale = if n_layers == 62 {
                    1.0 / ((hidden / n_heads.max(1)) as f32).sqrt()
                } else {
                    1.0 / (head_dim as f32).sqrt()
                };
                gemma3_block(
                    window,
                    10_000.0,
                    (0..n_layers).map(|l| (l + 1) % 6 != 0).collect(),
                    attention_scale,
                    hidden,
                )
            }
            _ if arch_name == "qwen3moe" || arch == Arch::Qwen3Next => {
                let experts = int("expert_count")?;
                let ffn = int("expert_feed_forward_length")?;
                let moe = Some(Moe {
                    experts,
                    top_k: int("expert_used_count")?,
                    ffn,
                    // llama.cpp renormalizes Qwen3-MoE's and Qwen3-Next's top-k weights unless told otherwise.
                    norm_top_k: g
                        .get(&key("expert_weights_norm"))
                        .and_then(|v| v.as_bool())
                        .unwrap_or(true),
                    // A layer is sparse where it has a router.
                    sparse: (0..n_layers)
                        .map(|l| g.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).is_some())
                        .collect(),
                    shared_ffn: optional_int("expert_shared_feed_forward_length")?,
                });
                if arch != Arch::Qwen3Next {
                    BlockStyle {
                        moe,
                        ..BlockStyle::default()
                    }
                } else {
                    // llama.cpp's qwen3next keys: the key heads are the SSM groups, the value heads its
                    // time-step rank; a layer is a Gated DeltaNet where it has the decay rates.
                    let value_heads = int("ssm.time_step_rank")?;
                    BlockStyle {
                        moe,
                        rotary_dims,
                        attention_gate: true,
                        linear: Some(LinearAttention {
                            key_heads: int("ssm.group_count")?,
                            value_heads,
                            key_dim: int("ssm.state_size")?,
                            value_dim: int("ssm.inner_size")? / value_heads.max(1),
                            conv_kernel: int("ssm.conv_kernel")?,
                            layers: (0..n_layers)
                                .map(|l| g.tensor(&format!("blk.{l}.ssm_a")).is_some())
                                .collect(),
                        }),
                        ..BlockStyle::default()
                    }
                }
            }
            _ => BlockStyle::default(),
        };
        let hp = HParams {
            arch,
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            // A mixture of experts alone may name no dense size.
            ffn_hidden: match (int("feed_forward_length"), &block.moe) {
                (Ok(f), _) => f,
                (Err(_), Some(m)) => m.ffn,
                (Err(e), None) => return Err(e),
            },
            vocab,
            rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_theta,
            rope_style,
            rope_scaling,
            tied_embeddings: tied,
            qkv_bias: g.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: arch == Arch::Qwen3Next || g.tensor("blk.0.attn_q_norm.weight").is_some(),
            context_len: optional_int("context_length")?.unwrap_or(DEFAULT_CONTEXT),
            block,
        };
        hp.check()
            .map_err(|m| Error::malformed(&g.path, format!("model hyper-parameters: {m}")))?;
        Ok(hp)
    }

    pub fn from_hf(cfg: &HfConfig) -> Result<Self> {
        let arch = match cfg.model_type.as_deref() {
            Some("llama") | Some("mistral") => Arch::Llama,
            Some("qwen2") | Some("qwen2_5_vl_text") => Arch::Qwen2,
            Some("qwen3") | Some("qwen3_moe") => Arch::Qwen3,
            Some("gemma3_text") => Arch::Gemma3,
            Some("qwen3_next") => Arch::Qwen3Next,
            other => {
                return Err(Error::Unsupported(format!(
                    "config.json model_type {other:?} (verity runs llama, mistral, qwen2, qwen3, qwen3_moe, \
                     qwen3_next, gemma3_text)"
                )))
            }
        };
        let moe = match cfg.model_type.as_deref() {
            Some("qwen3_moe") | Some("qwen3_next") => hf_moe(cfg, arch)?,
            _ => None,
        };
        if arch == Arch::Gemma3 {
            return Self::from_hf_gemma3(cfg);
        }
        // transformers ≥ 5 writes `rope_parameters: {rope_theta, rope_type}`; older configs a top-level
        // `rope_theta` and an optional `rope_scaling`.
        let params = cfg.rope_parameters.as_ref();
        let rope_type = params
            .and_then(|p| p.get("rope_type"))
            .or_else(|| {
                cfg.rope_scaling
                    .as_ref()
                    .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
            })
            .and_then(|t| t.as_str())
            // Qwen2.5-VL's published configs call their sectioned rotation `mrope`: nothing is stretched.
            .filter(|&t| t != "mrope");
        let scaling_params = params
            .filter(|p| p.get("rope_type").is_some())
            .or(cfg.rope_scaling.as_ref());
        let rope_scaling = hf_rope_scaling(rope_type, scaling_params, cfg.max_position_embeddings)?;
        let rope_theta = match (cfg.rope_theta, params.and_then(|p| p.get("rope_theta"))) {
            (Some(theta), _) => Some(theta),
            (None, None) => None,
            (None, Some(v)) => Some(v.as_f64().ok_or_else(|| {
                Error::Invalid(format!(
                    "config.json rope_parameters.rope_theta is not a number: {v}"
                ))
            })?),
        };
        let partial = cfg
            .partial_rotary_factor
            .or_else(|| params.and_then(|p| p.get("partial_rotary_factor")?.as_f64()));
        // Qwen3-Next rotates a quarter of each head unless its config says otherwise (transformers' default).
        let partial = partial.or((arch == Arch::Qwen3Next).then_some(0.25));
        let n_heads = cfg.num_attention_heads;
        let head_dim = cfg
            .head_dim
            .unwrap_or(cfg.hidden_size.checked_div(n_heads).unwrap_or(0));
        let rotary_dims = match partial {
            None => None,
            Some(1.0) => None,
            Some(f) if arch != Arch::Qwen3Next => {
                return Err(Error::Unsupported(format!(
                    "config.json partial_rotary_factor {f} (of verity's architectures only Qwen3-Next rotates \
                     part of each head)"
                )))
            }
            Some(f) if f > 0.0 && f < 1.0 => Some((head_dim as f64 * f) as usize),
            Some(f) => {
                return Err(Error::Invalid(format!(
                    "config.json partial_rotary_factor {f} (expected a share of the head, 0 to 1)"
                )))
            }
        };
        let hp = HParams {
            arch,
            n_layers: cfg.num_hidden_layers,
            hidden: cfg.hidden_size,
            n_heads,
            n_kv_heads: cfg.num_key_value_heads.unwrap_or(n_heads),
            head_dim,
            ffn_hidden: cfg.intermediate_size,
            vocab: cfg.vocab_size,
            rms_eps: cfg.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta.unwrap_or(10000.0) as f32,
            rope_style: RopeStyle::HalfSplit,
            rope_scaling,
            tied_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
            qkv_bias: match arch {
                Arch::Qwen2 => true,
                _ => cfg.attention_bias.unwrap_or(false),
            },
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Next),
            context_len: cfg.max_position_embeddings.unwrap_or(DEFAULT_CONTEXT),
            block: BlockStyle {
                sliding: hf_sliding_window(cfg, rope_theta.unwrap_or(10000.0) as f32)?,
                moe,
                rotary_dims,
                attention_gate: arch == Arch::Qwen3Next,
                mrope: hf_mrope(cfg, head_dim)?,
                linear: if arch == Arch::Qwen3Next {
                    Some(hf_linear_attention(cfg)?)
                } else {
                    None
                },
                ..BlockStyle::default()
            },
        };
        hp.validate()?;
        Ok(hp)
    }

    /// A `gemma3_text` config: transformers 5 keeps one `rope_parameters` entry per layer type, older configs
    /// `rope_theta` and `rope_local_base_freq`.
    fn from_hf_gemma3(cfg: &HfConfig) -> Result<Self> {
        let unsupported = |what: String| Err(Error::Unsupported(format!("config.json {what}")));
        if cfg.use_bidirectional_attention == Some(true) {
            return unsupported("use_bidirectional_attention (an embedding model)".into());
        }
        for (name, cap) in [
            ("final_logit_softcapping", cfg.final_logit_softcapping),
            ("attn_logit_softcapping", cfg.attn_logit_softcapping),
        ] {
            if let Some(c) = cap {
                return unsupported(format!("{name} {c} (Gemma 2's soft-capping)"));
            }
        }
        if let Some(act) = cfg
            .hidden_activation
            .as_deref()
            .filter(|a| *a != "gelu_pytorch_tanh")
        {
            return unsupported(format!(
                "hidden_activation {act:?} (Gemma 3 uses gelu_pytorch_tanh)"
            ));
        }
        let n_layers = cfg.num_hidden_layers;
        // (theta, rope type, the entry) of a layer type's entry in a transformers 5 config.
        type Entry<'a> = (Option<f64>, Option<&'a str>, &'a serde_json::Value);
        let entry = |kind: &str| -> Option<Entry<'_>> {
            let e = cfg.rope_parameters.as_ref()?.get(kind)?;
            Some((
                e.get("rope_theta").and_then(|v| v.as_f64()),
                e.get("rope_type").and_then(|v| v.as_str()),
                e,
            ))
        };
        let (global, local) = (entry("full_attention"), entry("sliding_attention"));
        if let Some(t) = local.and_then(|l| l.1).filter(|t| *t != "default") {
            return unsupported(format!(
                "rope type {t:?} on the sliding-window layers (verity scales the global layers' only)"
            ));
        }
        // The global layers' scaling (Gemma 3 4B and larger: linear).
        let rope_scaling = match global {
            Some((_, t, e)) => hf_rope_scaling(t, Some(e), cfg.max_position_embeddings)?,
            None => {
                let legacy = cfg.rope_scaling.as_ref();
                let t = legacy
                    .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
                    .and_then(|t| t.as_str());
                hf_rope_scaling(t, legacy, cfg.max_position_embeddings)?
            }
        };
        let rope_theta = global
            .and_then(|g| g.0)
            .or(cfg.rope_theta)
            .unwrap_or(1_000_000.0);
        let local_theta = local
            .and_then(|l| l.0)
            .or(cfg.rope_local_base_freq)
            .unwrap_or(10_000.0);
        let local_layers: Vec<bool> = match &cfg.layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(Error::Unsupported(format!(
                        "config.json layer type {other:?}"
                    ))),
                })
                .collect::<Result<_>>()?,
            None => {
                let pattern = cfg
                    .sliding_window_pattern
                    .or(cfg.sliding_window_pattern_legacy)
                    .unwrap_or(6)
                    .max(1);
                (0..n_layers).map(|l| (l + 1) % pattern != 0).collect()
            }
        };
        let head_dim = cfg.head_dim.unwrap_or(256);
        let n_heads = cfg.num_attention_heads;
        let scalar = cfg.query_pre_attn_scalar.unwrap_or(head_dim as f64);
        let window = cfg.sliding_window.unwrap_or(4096);
        let hp = HParams {
            arch: Arch::Gemma3,
            n_layers,
            hidden: cfg.hidden_size,
            n_heads,
            n_kv_heads: cfg.num_key_value_heads.unwrap_or(n_heads),
            head_dim,
            ffn_hidden: cfg.intermediate_size,
            vocab: cfg.vocab_size,
            rms_eps: cfg.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            rope_style: RopeStyle::HalfSplit,
            rope_scaling,
            tied_embeddings: cfg.tie_word_embeddings.unwrap_or(true),
            qkv_bias: cfg.attention_bias.unwrap_or(false),
            qk_norm: true,
            context_len: cfg.max_position_embeddings.unwrap_or(DEFAULT_CONTEXT),
            block: gemma3_block(
                window,
                local_theta as f32,
                local_layers,
                (1.0 / scalar.sqrt()) as f32,
                cfg.hidden_size,
            ),
        };
        hp.validate()?;
        Ok(hp)
    }
}

/// A GGUF's RoPE scaling: `rope.scaling.type` linear with its factor, or Llama 3's per-frequency factors as
/// llama.cpp's converter stores them (`rope_freqs.weight`), recognised as Llama 3's rule with the original
/// context the header names (8,192 where it names none) and the low/high frequency factors 1 and 4 — those of
/// every Llama 3.1–3.3 release — or refused; YaRN with llama.cpp's defaults. Anything else scaled (LongRoPE,
/// YaRN with its own betas or attention factor) is refused by name rather than computed as plain RoPE.
fn gguf_rope_scaling(
    g: &GgufFile,
    key: &dyn Fn(&str) -> String,
    head_dim: usize,
    theta: f32,
) -> Result<RopeScaling> {
    let unsupported = |what: String| {
        Err(Error::Unsupported(format!(
            "{}: {what} (verity implements unscaled, linear, Llama 3 and YaRN RoPE)",
            g.path.display()
        )))
    };
    let kind = g.get(&key("rope.scaling.type")).map(|v| v.as_str());
    let factor = match g.get(&key("rope.scaling.factor")) {
        None => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| {
                    Error::malformed(
                        &g.path,
                        format!(
                            "{} is not a positive number: {v:?}",
                            key("rope.scaling.factor")
                        ),
                    )
                })? as f32,
        ),
    };
    let scaling = match (kind, factor) {
        (None | Some(Some("none")), None) => RopeScaling::None,
        (None | Some(Some("none")), Some(1.0)) => RopeScaling::None,
        (Some(Some("linear")), Some(factor)) => RopeScaling::Linear { factor },
        (Some(Some("linear")), None) => RopeScaling::None,
        (Some(Some("yarn")), Some(factor)) => {
            // llama.cpp's YaRN: betas 32 and 1, attention factor 0.1·ln(factor) + 1, unless the file sets
            // its own (not implemented: refused by name below).
            let tuned = [
                "rope.scaling.attn_factor",
                "rope.scaling.yarn_log_multiplier",
                "rope.scaling.yarn_ext_factor",
                "rope.scaling.yarn_beta_fast",
                "rope.scaling.yarn_beta_slow",
            ]
            .into_iter()
            .find(|k| g.get(&key(k)).is_some());
            if let Some(k) = tuned {
                return unsupported(format!("YaRN with {}", key(k)));
            }
            let original = g
                .get(&key("rope.scaling.original_context_length"))
                .or_else(|| g.get(&key("context_length")))
                .and_then(|v| v.as_f64())
                .filter(|c| *c >= 1.0)
                .ok_or_else(|| {
                    Error::malformed(
                        &g.path,
                        format!(
                            "YaRN without {} or {}",
                            key("rope.scaling.original_context_length"),
                            key("context_length")
                        ),
                    )
                })?;
            RopeScaling::yarn(factor, original as f32)
        }
        (kind, factor) => {
            return unsupported(format!(
                "{} {kind:?} with factor {factor:?}",
                key("rope.scaling.type")
            ))
        }
    };
    let Some(t) = g.tensor("rope_freqs.weight") else {
        return Ok(scaling);
    };
    if scaling != RopeScaling::None
        || t.dims != [head_dim / 2]
        || t.ty != crate::quant::GgmlType::F32
    {
        return unsupported(format!(
            "rope_freqs.weight of shape {:?} ({}) with {} {kind:?}",
            t.dims,
            t.ty.name(),
            key("rope.scaling.type")
        ));
    }
    let stored: Vec<f32> = g
        .tensor_bytes(t)
        .as_slice()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let original_context = match g.get(&key("rope.scaling.original_context_length")) {
        Some(v) => v.as_f64().unwrap_or(0.0) as f32,
        None => 8192.0,
    };
    let llama3 = RopeScaling::Llama3 {
        factor: stored.iter().copied().fold(1.0, f32::max),
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context,
    };
    let follows = stored.iter().enumerate().all(|(i, &f)| {
        let want = llama3.divisor(theta, i, head_dim);
        (f as f64 - want).abs() <= 1e-5 * want
    });
    if !follows {
        return unsupported("rope_freqs.weight that does not follow Llama 3's rule".into());
    }
    Ok(llama3)
}

/// The local attention layers of a Llama-family config, as transformers reads them: `layer_types` where the
/// config lists them; else Mistral's `sliding_window` on every layer; else Qwen2/Qwen3's `use_sliding_window` on
/// the layers from `max_window_layers` on. Local layers rotate like the others.
fn hf_sliding_window(cfg: &HfConfig, rope_theta: f32) -> Result<Option<SlidingWindow>> {
    let n = cfg.num_hidden_layers;
    let local: Vec<bool> = match (&cfg.layer_types, cfg.model_type.as_deref()) {
        (Some(types), _) => types.iter().map(|t| t == "sliding_attention").collect(),
        (None, Some("mistral")) => vec![cfg.sliding_window.is_some(); n],
        (None, _) if cfg.use_sliding_window == Some(true) => {
            let from = cfg.max_window_layers.unwrap_or(28);
            (0..n).map(|l| l >= from).collect()
        }
        (None, _) => vec![false; n],
    };
    if !local.contains(&true) {
        return Ok(None);
    }
    // Qwen2 and Qwen3 configs keep a `sliding_window` value with `use_sliding_window: false`; only layers
    // marked local use it.
    let window = cfg.sliding_window.ok_or_else(|| {
        Error::Invalid("config.json marks sliding-window layers but has no sliding_window".into())
    })?;
    Ok(Some(SlidingWindow {
        window,
        rope_theta,
        local,
    }))
}

/// The scaling a config's `rope_type` (`None`/`default`: none) asks for, with its parameters from `params`.
/// A `qwen2_5_vl_text` config's `mrope_section` (in `rope_parameters` or the older `rope_scaling`; transformers'
/// default where neither names it): sections of the head's rotated pairs that must add up to all of them.
fn hf_mrope(cfg: &HfConfig, head_dim: usize) -> Result<Option<[usize; 3]>> {
    if cfg.model_type.as_deref() != Some("qwen2_5_vl_text") {
        return Ok(None);
    }
    let named = [&cfg.rope_parameters, &cfg.rope_scaling]
        .into_iter()
        .find_map(|p| p.as_ref()?.get("mrope_section"));
    let sections = match named {
        None => [16, 24, 24],
        Some(v) => {
            let parts: Option<Vec<usize>> = v
                .as_array()
                .filter(|a| a.len() == 3)
                .map(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
                .and_then(|v: Option<Vec<usize>>| v);
            let p = parts.ok_or_else(|| {
                Error::Invalid(format!(
                    "config.json mrope_section {v} (three counts expected)"
                ))
            })?;
            [p[0], p[1], p[2]]
        }
    };
    if sections.iter().sum::<usize>() != head_dim / 2 {
        return Err(Error::Invalid(format!(
            "config.json mrope_section {sections:?} does not add up to the {} rotated pairs of a head",
            head_dim / 2
        )));
    }
    Ok(Some(sections))
}

fn hf_rope_scaling(
    rope_type: Option<&str>,
    params: Option<&serde_json::Value>,
    max_positions: Option<usize>,
) -> Result<RopeScaling> {
    let opt = |k: &str| -> Result<Option<f64>> {
        match params.and_then(|p| p.get(k)) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|v| v.is_finite())
                .map(Some)
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "config.json rope scaling {rope_type:?}: {k} is not a number: {v}"
                    ))
                }),
        }
    };
    let num = |k: &str| -> Result<f32> {
        params
            .and_then(|p| p.get(k))
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "config.json rope scaling {rope_type:?} without a positive {k}"
                ))
            })
    };
    Ok(match rope_type {
        None | Some("default") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: num("factor")?,
        },
        Some("llama3") => {
            let scaling = RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_context: num("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = scaling
            {
                if high_freq_factor <= low_freq_factor {
                    return Err(Error::Invalid(
                        "config.json llama3 rope scaling with high_freq_factor ≤ low_freq_factor"
                            .into(),
                    ));
                }
            }
            scaling
        }
        Some("yarn") => {
            // transformers' `_compute_yarn_parameters`: the original context from the parameters or the
            // config's positions; a factor left out is their ratio; the attention factor given, or from
            // DeepSeek's `mscale`/`mscale_all_dim`, or 0.1·ln(factor) + 1; betas 32 and 1 where unset or 0.
            let original = opt("original_max_position_embeddings")?
                .or(max_positions.map(|p| p as f64))
                .filter(|c| *c >= 1.0)
                .ok_or_else(|| {
                    Error::Invalid(
                        "config.json yarn rope scaling without original_max_position_embeddings or \
                         max_position_embeddings"
                            .into(),
                    )
                })?;
            let no_factor = || {
                Error::Invalid(
                    "config.json yarn rope scaling without a factor or max_position_embeddings"
                        .into(),
                )
            };
            let factor = match opt("factor")? {
                Some(f) => f,
                None => max_positions.ok_or_else(no_factor)? as f64 / original,
            };
            if factor <= 0.0 {
                return Err(Error::Invalid(format!(
                    "config.json yarn rope scaling with factor {factor}"
                )));
            }
            let attention_factor = match (
                opt("attention_factor")?,
                opt("mscale")?,
                opt("mscale_all_dim")?,
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    yarn_mscale(factor, m) / yarn_mscale(factor, all)
                }
                _ => yarn_mscale(factor, 1.0),
            };
            // A beta counts turns over the original context: a negative one has no meaning (its logarithm none).
            let beta = |k: &str, default: f64| -> Result<f64> {
                match opt(k)?.filter(|b| *b != 0.0).unwrap_or(default) {
                    b if b > 0.0 => Ok(b),
                    b => Err(Error::Invalid(format!(
                        "config.json yarn rope scaling with {k} {b}"
                    ))),
                }
            };
            let truncate = match params.and_then(|p| p.get("truncate")) {
                None | Some(serde_json::Value::Null) => true,
                Some(v) => v.as_bool().ok_or_else(|| {
                    Error::Invalid(format!(
                        "config.json yarn rope scaling: truncate is not a boolean: {v}"
                    ))
                })?,
            };
            RopeScaling::Yarn {
                factor: factor as f32,
                original_context: original as f32,
                beta_fast: beta("beta_fast", 32.0)? as f32,
                beta_slow: beta("beta_slow", 1.0)? as f32,
                attention_factor: attention_factor as f32,
                truncate,
            }
        }
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "rope type {other:?} in config.json (verity implements default, linear, llama3 and yarn)"
            )));
        }
    })
}

/// Gemma 3's blocks: GeGLU, post-norms, embeddings scaled by √hidden, local layers of `window` positions.
/// A `qwen3_moe` or `qwen3_next` config's mixture: which layers are sparse (transformers' rule: not in
/// `mlp_only_layers`, and every `decoder_sparse_step`-th layer), how many experts, how many per token, their
/// size, and Qwen3-Next's shared expert. A `qwen3_next` config without experts is dense (`None`).
fn hf_moe(cfg: &HfConfig, arch: Arch) -> Result<Option<Moe>> {
    let missing = |k: &str| Error::Invalid(format!("config.json: a mixture of experts needs {k}"));
    let Some(experts) = cfg.num_experts.or(cfg.num_local_experts) else {
        if arch == Arch::Qwen3Next {
            return Ok(None);
        }
        return Err(missing("num_experts"));
    };
    if experts == 0 && arch == Arch::Qwen3Next {
        return Ok(None);
    }
    let top_k = cfg
        .num_experts_per_tok
        .ok_or_else(|| missing("num_experts_per_tok"))?;
    let ffn = cfg
        .moe_intermediate_size
        .ok_or_else(|| missing("moe_intermediate_size"))?;
    let shared_ffn = cfg.shared_expert_intermediate_size.filter(|&s| s > 0);
    if shared_ffn.is_some() && arch != Arch::Qwen3Next {
        return Err(Error::Unsupported(
            "config.json: shared experts outside Qwen3-Next (Qwen2-MoE style) are not supported"
                .into(),
        ));
    }
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(Error::Invalid(format!(
            "config.json: {top_k} experts per token of {experts}"
        )));
    }
    let step = cfg.decoder_sparse_step.unwrap_or(1).max(1);
    let dense = cfg.mlp_only_layers.clone().unwrap_or_default();
    Ok(Some(Moe {
        experts,
        top_k,
        ffn,
        norm_top_k: cfg.norm_topk_prob.unwrap_or(false),
        sparse: (0..cfg.num_hidden_layers)
            .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
            .collect(),
        shared_ffn,
    }))
}

/// A `qwen3_next` config's Gated DeltaNet layers: those `layer_types` marks `linear_attention`, or (published
/// configs) every layer but each `full_attention_interval`-th (default 4).
fn hf_linear_attention(cfg: &HfConfig) -> Result<LinearAttention> {
    let n = cfg.num_hidden_layers;
    let layers = match &cfg.layer_types {
        Some(types) => {
            if types.len() != n {
                return Err(Error::Invalid(format!(
                    "config.json: {} layer_types for {n} layers",
                    types.len()
                )));
            }
            if let Some(t) = types
                .iter()
                .find(|t| !matches!(t.as_str(), "linear_attention" | "full_attention"))
            {
                return Err(Error::Unsupported(format!(
                    "config.json: a qwen3_next layer of type {t:?}"
                )));
            }
            types.iter().map(|t| t == "linear_attention").collect()
        }
        None => {
            let every = cfg.full_attention_interval.unwrap_or(4).max(1);
            (0..n).map(|l| (l + 1) % every != 0).collect()
        }
    };
    Ok(LinearAttention {
        key_heads: cfg.linear_num_key_heads.unwrap_or(16),
        value_heads: cfg.linear_num_value_heads.unwrap_or(32),
        key_dim: cfg.linear_key_head_dim.unwrap_or(128),
        value_dim: cfg.linear_value_head_dim.unwrap_or(128),
        conv_kernel: cfg.linear_conv_kernel_dim.unwrap_or(4),
        layers,
    })
}

fn gemma3_block(
    window: usize,
    local_theta: f32,
    local: Vec<bool>,
    attention_scale: f32,
    hidden: usize,
) -> BlockStyle {
    BlockStyle {
        glu: Glu::GeluTanh,
        post_norms: true,
        embedding_scale: Some((hidden as f32).sqrt()),
        attention_scale: Some(attention_scale),
        sliding: Some(SlidingWindow {
            window,
            rope_theta: local_theta,
            local,
        }),
        ..BlockStyle::default()
    }
}

/// The decoder's config of a `config.json`, and whether it was nested: an image-text Gemma 3 checkpoint
/// (`model_type: gemma3`) keeps its text model's config in `text_config`, which names only what differs from
/// `Gemma3TextConfig`'s defaults — filled in here as transformers fills them. Any other config as it is.
pub fn text_model_config(config: serde_json::Value) -> (serde_json::Value, bool) {
    let model_type = config.get("model_type").and_then(|t| t.as_str());
    if model_type == Some("qwen2_5_vl") {
        return (qwen25_vl_text_config(config), true);
    }
    let nested =
        model_type == Some("gemma3") && config.get("text_config").is_some_and(|t| t.is_object());
    if !nested {
        return (config, false);
    }
    let mut text = config["text_config"].clone();
    let defaults = serde_json::json!({
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": config.get("tie_word_embeddings").cloned().unwrap_or(serde_json::Value::Bool(true)),
    });
    let obj = text.as_object_mut().expect("checked above");
    for (k, v) in defaults.as_object().expect("a literal object") {
        obj.entry(k.clone()).or_insert_with(|| v.clone());
    }
    (text, true)
}

/// A Qwen2.5-VL config's text model: transformers 5 nests it in `text_config`; published checkpoints keep its
/// fields at the top level beside `vision_config`. Either way as a `qwen2_5_vl_text` config (Qwen2 blocks with
/// multimodal rotary positions), tied embeddings as the outer config says.
fn qwen25_vl_text_config(config: serde_json::Value) -> serde_json::Value {
    let mut text = match config.get("text_config") {
        Some(t) if t.is_object() => t.clone(),
        _ => config.clone(),
    };
    let obj = text.as_object_mut().expect("a JSON object");
    obj.insert("model_type".into(), "qwen2_5_vl_text".into());
    if let Some(tied) = config.get("tie_word_embeddings") {
        obj.insert("tie_word_embeddings".into(), tied.clone());
    }
    obj.remove("vision_config");
    text
}

/// The fields of a Hugging Face `config.json` that verity reads.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<usize>,
    pub attention_bias: Option<bool>,
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_parameters: Option<serde_json::Value>,
    /// The share of each head that RoPE rotates (Qwen3-Next, Phi, StableLM).
    pub partial_rotary_factor: Option<f64>,
    pub bos_token_id: Option<serde_json::Value>,
    pub eos_token_id: Option<serde_json::Value>,
    /// MLX affine quantization: `{"group_size": G, "bits": B}`, possibly with per-module overrides.
    pub quantization: Option<serde_json::Value>,
    pub quantization_config: Option<serde_json::Value>,
    /// Native MTP heads (DeepSeek-V3, MiMo, Qwen3-Next).
    pub num_nextn_predict_layers: Option<usize>,
    /// The same, as Qwen3.5-style configs name it.
    pub mtp_num_hidden_layers: Option<usize>,
    // Gemma 3 (`gemma3_text`).
    pub hidden_activation: Option<String>,
    pub query_pre_attn_scalar: Option<f64>,
    pub sliding_window: Option<usize>,
    /// `sliding_attention` or `full_attention` per layer.
    pub layer_types: Option<Vec<String>>,
    pub rope_local_base_freq: Option<f64>,
    pub sliding_window_pattern: Option<usize>,
    /// What transformers 4.5x writes for `sliding_window_pattern`.
    #[serde(rename = "_sliding_window_pattern")]
    pub sliding_window_pattern_legacy: Option<usize>,
    pub final_logit_softcapping: Option<f64>,
    // Qwen3-MoE (`num_experts` in published configs, `num_local_experts` as transformers 5 writes it).
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub attn_logit_softcapping: Option<f64>,
    pub use_bidirectional_attention: Option<bool>,
    /// Qwen2/Qwen3: whether layers from `max_window_layers` on attend to a sliding window.
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    // Qwen3-Next's Gated DeltaNet layers (transformers' defaults where absent).
    pub full_attention_interval: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_conv_kernel_dim: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Rope;

    fn moe_config(extra: serde_json::Value) -> Result<HParams> {
        let mut cfg = serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        });
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        HParams::from_hf(&serde_json::from_value(cfg).unwrap())
    }

    #[test]
    fn qwen3_moe_layers_are_sparse_as_transformers_decides() {
        let hp = moe_config(serde_json::json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}))
            .unwrap();
        let m = hp.block.moe.unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_top_k), (8, 2, 32, false));
        // Every second layer (1, 3, 5), but not layer 3.
        assert_eq!(m.sparse, vec![false, true, false, false, false, true]);
        assert!(hp.qk_norm);
        // transformers 5 writes `num_local_experts`.
        let v5 = serde_json::json!({"num_experts": null, "num_local_experts": 4, "norm_topk_prob": true});
        let m = moe_config(v5).unwrap().block.moe.unwrap();
        assert_eq!((m.experts, m.norm_top_k), (4, true));
    }

    #[test]
    fn an_incomplete_or_foreign_mixture_is_refused() {
        let err = |extra| moe_config(extra).unwrap_err().to_string();
        assert!(
            err(serde_json::json!({"num_experts_per_tok": null})).contains("num_experts_per_tok")
        );
        assert!(err(serde_json::json!({"num_experts_per_tok": 9})).contains("9 experts per token"));
        assert!(
            err(serde_json::json!({"shared_expert_intermediate_size": 64}))
                .contains("shared experts")
        );
    }

    /// A published Qwen3-Next config (`Qwen/Qwen3-Next-80B-A3B-Instruct`'s keys, smaller): no `layer_types`, a
    /// top-level RoPE base and partial factor, a shared expert.
    #[test]
    fn a_qwen3_next_config_has_linear_layers_partial_rope_and_a_shared_expert() {
        let cfg = serde_json::json!({
            "model_type": "qwen3_next", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
            "rope_theta": 10000000, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        });
        let hp = HParams::from_hf(&serde_json::from_value(cfg.clone()).unwrap()).unwrap();
        assert_eq!(hp.arch, Arch::Qwen3Next);
        assert!(hp.qk_norm && hp.block.attention_gate);
        assert_eq!(hp.block.rotary_dims, Some(8));
        let la = hp.block.linear.clone().unwrap();
        // Every fourth layer is full attention.
        let full: Vec<usize> = (0..8).filter(|&l| !la.layers[l]).collect();
        assert_eq!(full, vec![3, 7]);
        // Q and K of 2 key heads × 8, V of 4 value heads × 16: 96 channels, 3 past inputs each, and 4 states of
        // 8 × 16.
        assert_eq!(
            (la.conv_channels(), la.state_len()),
            (96, 96 * 3 + 4 * 8 * 16)
        );
        assert_eq!(hp.block.moe.unwrap().shared_ffn, Some(24));
        // Without a partial factor, transformers' default for Qwen3-Next: a quarter.
        let mut plain = cfg.clone();
        plain
            .as_object_mut()
            .unwrap()
            .remove("partial_rotary_factor");
        let hp = HParams::from_hf(&serde_json::from_value(plain).unwrap()).unwrap();
        assert_eq!(hp.block.rotary_dims, Some(8));
        // A layer type verity does not know is refused by name; value heads must share key heads evenly.
        let mut odd = cfg.clone();
        odd["layer_types"] = serde_json::json!([
            "linear_attention",
            "full_attention",
            "mamba",
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention"
        ]);
        let e = HParams::from_hf(&serde_json::from_value(odd).unwrap()).unwrap_err();
        assert!(e.to_string().contains("\"mamba\""), "{e}");
        let mut uneven = cfg;
        uneven["linear_num_value_heads"] = serde_json::json!(3);
        assert!(HParams::from_hf(&serde_json::from_value(uneven).unwrap()).is_err());
    }

    /// YaRN from a config's rope parameters, as transformers computes it (`scripts/fixtures/yarn_reference.py`
    /// restates `_compute_yarn_parameters` in float64: explicit and default betas, DeepSeek's mscale pair, the
    /// untruncated ramp): each pair's frequency, the attention factor, and the rotation `Rope::angle` gives.
    #[test]
    fn yarn_rope_scaling_is_transformers_yarn() {
        let text = include_str!("../../tests/fixtures/rope/yarn.json");
        let fixture: serde_json::Value = serde_json::from_str(text).unwrap();
        for case in fixture["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let mut params = serde_json::json!({
                "rope_type": "yarn", "factor": case["factor"],
                "original_max_position_embeddings": case["original"], "truncate": case["truncate"],
            });
            for k in ["beta_fast", "beta_slow", "mscale", "mscale_all_dim"] {
                if !case[k].is_null() {
                    params[k] = case[k].clone();
                }
            }
            let scaling = hf_rope_scaling(Some("yarn"), Some(&params), Some(1 << 20)).unwrap();
            let (d, theta) = (
                case["head_dim"].as_u64().unwrap() as usize,
                case["theta"].as_f64().unwrap() as f32,
            );
            let want_m = case["attention_factor"].as_f64().unwrap();
            assert!((scaling.magnitude() as f64 - want_m).abs() < 1e-6, "{name}");
            let rope = Rope {
                theta,
                style: RopeStyle::Interleaved,
                scaling,
                dims: None,
                mrope: None,
            };
            for (i, want) in case["inv_freq"].as_array().unwrap().iter().enumerate() {
                let want = want.as_f64().unwrap();
                let got =
                    (theta as f64).powf(-2.0 * i as f64 / d as f64) / scaling.divisor(theta, i, d);
                assert!(
                    (got - want).abs() <= 1e-9 * want,
                    "{name} pair {i}: {got} vs {want}"
                );
                let pos = 1000;
                let (c, s) = rope.angle(pos, i, d);
                let a = pos as f64 * want;
                assert!(
                    (c as f64 - want_m * a.cos()).abs() < 1e-5,
                    "{name} pair {i}"
                );
                assert!(
                    (s as f64 - want_m * a.sin()).abs() < 1e-5,
                    "{name} pair {i}"
                );
            }
        }
    }

    /// A YaRN config without a factor takes the ratio of its positions to the original context; without an
    /// original context, its positions; bad values are errors; a GGUF-convertible YaRN is the defaults'.
    #[test]
    fn yarn_config_defaults_and_errors() {
        let p = serde_json::json!({"rope_type": "yarn", "original_max_position_embeddings": 4096});
        match hf_rope_scaling(Some("yarn"), Some(&p), Some(16384)).unwrap() {
            RopeScaling::Yarn {
                factor,
                original_context,
                attention_factor,
                ..
            } => {
                assert_eq!((factor, original_context), (4.0, 4096.0));
                assert!((attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
            }
            other => panic!("{other:?}"),
        }
        let p = serde_json::json!({"rope_type": "yarn", "factor": 2.0});
        assert_eq!(
            hf_rope_scaling(Some("yarn"), Some(&p), Some(8192)).unwrap(),
            RopeScaling::yarn(2.0, 8192.0)
        );
        assert!(hf_rope_scaling(Some("yarn"), Some(&p), None).is_err());
        let no_factor =
            serde_json::json!({"rope_type": "yarn", "original_max_position_embeddings": 4096});
        assert!(hf_rope_scaling(Some("yarn"), Some(&no_factor), None).is_err());
        for bad in [
            serde_json::json!({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 8}),
            serde_json::json!({"rope_type": "yarn", "factor": -1.0, "original_max_position_embeddings": 8}),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_slow": -1.0}),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "truncate": 1}),
        ] {
            assert!(
                hf_rope_scaling(Some("yarn"), Some(&bad), Some(64)).is_err(),
                "{bad}"
            );
        }
    }

    /// A GGUF's YaRN as llama.cpp writes it: `rope.scaling.type` yarn with its factor and the original context
    /// (else the training context) takes llama.cpp's defaults; a file that tunes YaRN's betas or attention factor
    /// is refused by name.
    #[test]
    fn gguf_yarn_takes_llama_cpp_defaults_and_refuses_tuned_files() {
        use crate::bundle::gguf_writer::GgufWriter;
        let path = std::env::temp_dir().join(format!("verity-yarn-{}.gguf", std::process::id()));
        let read = |extra: &dyn Fn(&mut GgufWriter)| {
            let mut w = GgufWriter::new();
            w.set_str("general.architecture", "llama");
            w.set_u32("llama.context_length", 131_072);
            w.set_str("llama.rope.scaling.type", "yarn");
            w.set_f32("llama.rope.scaling.factor", 4.0);
            extra(&mut w);
            std::fs::write(&path, w.header()).unwrap();
            let g = GgufFile::open(&path).unwrap();
            gguf_rope_scaling(&g, &|k: &str| format!("llama.{k}"), 128, 1e6)
        };
        assert_eq!(read(&|_| {}).unwrap(), RopeScaling::yarn(4.0, 131_072.0));
        let with_original =
            read(&|w| w.set_u32("llama.rope.scaling.original_context_length", 32_768));
        assert_eq!(with_original.unwrap(), RopeScaling::yarn(4.0, 32_768.0));
        let tuned = read(&|w| w.set_f32("llama.rope.scaling.yarn_beta_fast", 16.0)).unwrap_err();
        assert!(tuned.to_string().contains("yarn_beta_fast"), "{tuned}");
        std::fs::remove_file(&path).unwrap();
    }
}
