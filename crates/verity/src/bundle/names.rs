//! The tensors a decoder layer stack needs, and what each bundle format calls them.

use super::hparams::Arch;

/// A tensor of the model, named independently of the file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKey {
    TokenEmbedding,
    OutputNorm,
    Output,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    QNorm(usize),
    KNorm(usize),
    FfnNorm(usize),
    /// Gemma: the norm of the attention output before the residual add.
    AttnPostNorm(usize),
    /// Gemma: the norm of the MLP output before the residual add.
    FfnPostNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// A mixture-of-experts layer's router (one row per expert).
    Router(usize),
    /// Expert `e`'s gate, up and down projections in layer `l`: (l, e).
    ExpertGate(usize, usize),
    ExpertUp(usize, usize),
    ExpertDown(usize, usize),
}

impl TensorKey {
    /// The GGUF (llama.cpp) name.
    pub fn gguf(self) -> String {
        use TensorKey::*;
        match self {
            TokenEmbedding => "token_embd.weight".into(),
            OutputNorm => "output_norm.weight".into(),
            Output => "output.weight".into(),
            AttnNorm(l) => format!("blk.{l}.attn_norm.weight"),
            Q(l) => format!("blk.{l}.attn_q.weight"),
            K(l) => format!("blk.{l}.attn_k.weight"),
            V(l) => format!("blk.{l}.attn_v.weight"),
            O(l) => format!("blk.{l}.attn_output.weight"),
            QBias(l) => format!("blk.{l}.attn_q.bias"),
            KBias(l) => format!("blk.{l}.attn_k.bias"),
            VBias(l) => format!("blk.{l}.attn_v.bias"),
            QNorm(l) => format!("blk.{l}.attn_q_norm.weight"),
            KNorm(l) => format!("blk.{l}.attn_k_norm.weight"),
            FfnNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            AttnPostNorm(l) => format!("blk.{l}.post_attention_norm.weight"),
            FfnPostNorm(l) => format!("blk.{l}.post_ffw_norm.weight"),
            Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            Up(l) => format!("blk.{l}.ffn_up.weight"),
            Down(l) => format!("blk.{l}.ffn_down.weight"),
            Router(l) => format!("blk.{l}.ffn_gate_inp.weight"),
            // llama.cpp stacks each projection's experts into one 3-D tensor ([`TensorKey::expert`] picks one).
            ExpertGate(l, _) => format!("blk.{l}.ffn_gate_exps.weight"),
            ExpertUp(l, _) => format!("blk.{l}.ffn_up_exps.weight"),
            ExpertDown(l, _) => format!("blk.{l}.ffn_down_exps.weight"),
        }
    }

    /// The expert of an expert's projection (its index in the GGUF's stacked tensor).
    pub fn expert(self) -> Option<usize> {
        match self {
            TensorKey::ExpertGate(_, e)
            | TensorKey::ExpertUp(_, e)
            | TensorKey::ExpertDown(_, e) => Some(e),
            _ => None,
        }
    }

    /// The layer index of a per-layer tensor.
    pub fn layer(self) -> Option<usize> {
        use TensorKey::*;
        match self {
            TokenEmbedding | OutputNorm | Output => None,
            AttnNorm(l) | Q(l) | K(l) | V(l) | O(l) | QBias(l) | KBias(l) | VBias(l) | QNorm(l)
            | KNorm(l) | FfnNorm(l) | AttnPostNorm(l) | FfnPostNorm(l) | Gate(l) | Up(l)
            | Down(l) | Router(l) => Some(l),
            ExpertGate(l, _) | ExpertUp(l, _) | ExpertDown(l, _) => Some(l),
        }
    }

    /// The Hugging Face module path of a per-layer tensor inside its layer (`self_attn.q_proj`), as Llama-family
    /// models name them ([`TensorKey::hf_module`] has the names of any architecture).
    pub fn hf_layer_module(self) -> Option<&'static str> {
        use TensorKey::*;
        Some(match self {
            TokenEmbedding | OutputNorm | Output => return None,
            AttnNorm(_) => "input_layernorm",
            Q(_) | QBias(_) => "self_attn.q_proj",
            K(_) | KBias(_) => "self_attn.k_proj",
            V(_) | VBias(_) => "self_attn.v_proj",
            O(_) => "self_attn.o_proj",
            QNorm(_) => "self_attn.q_norm",
            KNorm(_) => "self_attn.k_norm",
            FfnNorm(_) => "post_attention_layernorm",
            AttnPostNorm(_) => "post_attention_layernorm",
            FfnPostNorm(_) => "post_feedforward_layernorm",
            Gate(_) => "mlp.gate_proj",
            Up(_) => "mlp.up_proj",
            Down(_) => "mlp.down_proj",
            Router(_) => "mlp.gate",
            ExpertGate(..) | ExpertUp(..) | ExpertDown(..) => return None,
        })
    }

    /// The Hugging Face transformers name in a model of `arch`, without the `.weight`/`.bias` suffix (MLX adds
    /// `.scales`/`.biases`). Gemma calls its norm before the MLP `pre_feedforward_layernorm` and gives Llama's
    /// name for it to the norm after attention.
    pub fn hf_module(self, arch: Arch) -> String {
        let expert = |l: usize, e: usize, p: &str| format!("model.layers.{l}.mlp.experts.{e}.{p}");
        match self {
            TensorKey::ExpertGate(l, e) => return expert(l, e, "gate_proj"),
            TensorKey::ExpertUp(l, e) => return expert(l, e, "up_proj"),
            TensorKey::ExpertDown(l, e) => return expert(l, e, "down_proj"),
            _ => {}
        }
        let module = match (arch, self) {
            (Arch::Gemma3, TensorKey::FfnNorm(_)) => Some("pre_feedforward_layernorm"),
            _ => self.hf_layer_module(),
        };
        match (self, self.layer(), module) {
            (_, Some(l), Some(m)) => format!("model.layers.{l}.{m}"),
            (TensorKey::TokenEmbedding, ..) => "model.embed_tokens".into(),
            (TensorKey::OutputNorm, ..) => "model.norm".into(),
            _ => "lm_head".into(),
        }
    }

    /// `.weight` or `.bias`.
    pub fn hf_suffix(self) -> &'static str {
        use TensorKey::*;
        match self {
            QBias(_) | KBias(_) | VBias(_) => "bias",
            _ => "weight",
        }
    }

    /// The Hugging Face tensor name in a model of `arch`.
    pub fn hf(self, arch: Arch) -> String {
        format!("{}.{}", self.hf_module(arch), self.hf_suffix())
    }

    /// A norm weight (Gemma's checkpoints store these as `w - 1`).
    pub fn is_norm(self) -> bool {
        use TensorKey::*;
        matches!(
            self,
            OutputNorm
                | AttnNorm(_)
                | QNorm(_)
                | KNorm(_)
                | FfnNorm(_)
                | AttnPostNorm(_)
                | FfnPostNorm(_)
        )
    }
}
