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
    /// Qwen3-Next: the per-head output gates, stored interleaved with Q in the Q projection (`[q_h, gate_h]`
    /// per head h): [`Bundle::matrix`](super::Bundle::matrix) takes its rows out.
    QGate(usize),
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
    /// A mixture's shared expert (run for every token): gate, up and down projections, and the one-row
    /// projection whose sigmoid scales its output.
    SharedGate(usize),
    SharedUp(usize),
    SharedDown(usize),
    SharedWeight(usize),
    /// A Gated DeltaNet (linear attention) layer: the fused Q/K/V/Z input projection, the fused β/α one, the
    /// short convolution's taps (`[channels, 1, kernel]`), the time-step bias and log decay rate per value head,
    /// the gated output norm (plain weights), the output projection.
    LinearQkvz(usize),
    /// The same projection split (Qwen3.5's checkpoints, llama.cpp's current GGUFs): every key head's Q, then
    /// every K, then every value head's V; and every value head's Z.
    LinearQkv(usize),
    LinearZ(usize),
    LinearBa(usize),
    LinearConv(usize),
    LinearDtBias(usize),
    LinearALog(usize),
    LinearNorm(usize),
    LinearOut(usize),
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
            Q(l) | QGate(l) => format!("blk.{l}.attn_q.weight"),
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
            SharedGate(l) => format!("blk.{l}.ffn_gate_shexp.weight"),
            SharedUp(l) => format!("blk.{l}.ffn_up_shexp.weight"),
            SharedDown(l) => format!("blk.{l}.ffn_down_shexp.weight"),
            SharedWeight(l) => format!("blk.{l}.ffn_gate_inp_shexp.weight"),
            LinearQkvz(l) => format!("blk.{l}.ssm_in.weight"),
            LinearQkv(l) => format!("blk.{l}.attn_qkv.weight"),
            LinearZ(l) => format!("blk.{l}.attn_gate.weight"),
            LinearBa(l) => format!("blk.{l}.ssm_ba.weight"),
            LinearConv(l) => format!("blk.{l}.ssm_conv1d.weight"),
            LinearDtBias(l) => format!("blk.{l}.ssm_dt.bias"),
            LinearALog(l) => format!("blk.{l}.ssm_a"),
            LinearNorm(l) => format!("blk.{l}.ssm_norm.weight"),
            LinearOut(l) => format!("blk.{l}.ssm_out.weight"),
        }
    }

    /// The GGUF name in a model of `arch`: llama.cpp's qwen3next files call the norm before the MLP
    /// `post_attention_norm`, as transformers does.
    pub fn gguf_in(self, arch: Arch) -> String {
        match (arch, self) {
            (Arch::Qwen3Next, TensorKey::FfnNorm(l)) => {
                format!("blk.{l}.post_attention_norm.weight")
            }
            _ => self.gguf(),
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
            AttnNorm(l) | Q(l) | QGate(l) | K(l) | V(l) | O(l) | QBias(l) | KBias(l) | VBias(l)
            | QNorm(l) | KNorm(l) | FfnNorm(l) | AttnPostNorm(l) | FfnPostNorm(l) | Gate(l)
            | Up(l) | Down(l) | Router(l) | SharedGate(l) | SharedUp(l) | SharedDown(l)
            | SharedWeight(l) | LinearQkvz(l) | LinearQkv(l) | LinearZ(l) | LinearBa(l)
            | LinearConv(l) | LinearDtBias(l) | LinearALog(l) | LinearNorm(l) | LinearOut(l) => {
                Some(l)
            }
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
            Q(_) | QGate(_) | QBias(_) => "self_attn.q_proj",
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
            SharedGate(_) => "mlp.shared_expert.gate_proj",
            SharedUp(_) => "mlp.shared_expert.up_proj",
            SharedDown(_) => "mlp.shared_expert.down_proj",
            SharedWeight(_) => "mlp.shared_expert_gate",
            LinearQkvz(_) => "linear_attn.in_proj_qkvz",
            LinearQkv(_) => "linear_attn.in_proj_qkv",
            LinearZ(_) => "linear_attn.in_proj_z",
            LinearBa(_) => "linear_attn.in_proj_ba",
            LinearConv(_) => "linear_attn.conv1d",
            LinearDtBias(_) => "linear_attn.dt_bias",
            LinearALog(_) => "linear_attn.A_log",
            LinearNorm(_) => "linear_attn.norm",
            LinearOut(_) => "linear_attn.out_proj",
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

    /// `weight` or `bias`, or nothing where the parameter is not a module's (a DeltaNet's `dt_bias`, `A_log`).
    pub fn hf_suffix(self) -> Option<&'static str> {
        use TensorKey::*;
        match self {
            QBias(_) | KBias(_) | VBias(_) => Some("bias"),
            LinearDtBias(_) | LinearALog(_) => None,
            _ => Some("weight"),
        }
    }

    /// The Hugging Face tensor name of a per-layer tensor inside its layer (`self_attn.q_proj.weight`), as
    /// Llama-family models name them.
    pub fn hf_layer_name(self) -> Option<String> {
        if let Some(e) = self.expert() {
            let projection = match self {
                TensorKey::ExpertGate(..) => "gate_proj",
                TensorKey::ExpertUp(..) => "up_proj",
                _ => "down_proj",
            };
            return Some(format!("mlp.experts.{e}.{projection}.weight"));
        }
        let module = self.hf_layer_module()?;
        Some(match self.hf_suffix() {
            Some(suffix) => format!("{module}.{suffix}"),
            None => module.to_string(),
        })
    }

    /// The Hugging Face tensor name in a model of `arch`.
    pub fn hf(self, arch: Arch) -> String {
        match self.hf_suffix() {
            Some(suffix) => format!("{}.{suffix}", self.hf_module(arch)),
            None => self.hf_module(arch),
        }
    }

    /// Whether a safetensors checkpoint of `arch` stores this tensor as `w - 1` (Gemma's and Qwen3-Next's
    /// norms scale by `1 + w`; a DeltaNet's gated output norm is not one of them): its reader adds the 1.
    pub fn stored_minus_one(self, arch: Arch) -> bool {
        matches!(arch, Arch::Gemma3 | Arch::Qwen3Next) && self.is_norm()
    }

    /// The query rows of the Q projection (`QGate`: the gate rows) where a model of head size `head_dim` stores
    /// `[q_h, gate_h]` per head; `rows` of them.
    pub fn gated_q_rows(self, head_dim: usize, rows: usize) -> Vec<u32> {
        let skip = if matches!(self, TensorKey::QGate(_)) {
            head_dim
        } else {
            0
        };
        (0..rows)
            .map(|r| ((r / head_dim) * 2 * head_dim + skip + r % head_dim) as u32)
            .collect()
    }

    /// A norm weight (Gemma's and Qwen3-Next's checkpoints store these as `w - 1`; a DeltaNet's gated output
    /// norm is not one of them).
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
