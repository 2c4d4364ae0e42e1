//! The tensors a decoder layer stack needs, and what each bundle format calls them.

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
    Gate(usize),
    Up(usize),
    Down(usize),
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
            Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            Up(l) => format!("blk.{l}.ffn_up.weight"),
            Down(l) => format!("blk.{l}.ffn_down.weight"),
        }
    }

    /// The Hugging Face transformers name, without the `.weight`/`.bias` suffix (MLX adds `.scales`/`.biases`).
    pub fn hf_module(self) -> String {
        use TensorKey::*;
        match self {
            TokenEmbedding => "model.embed_tokens".into(),
            OutputNorm => "model.norm".into(),
            Output => "lm_head".into(),
            AttnNorm(l) => format!("model.layers.{l}.input_layernorm"),
            Q(l) | QBias(l) => format!("model.layers.{l}.self_attn.q_proj"),
            K(l) | KBias(l) => format!("model.layers.{l}.self_attn.k_proj"),
            V(l) | VBias(l) => format!("model.layers.{l}.self_attn.v_proj"),
            O(l) => format!("model.layers.{l}.self_attn.o_proj"),
            QNorm(l) => format!("model.layers.{l}.self_attn.q_norm"),
            KNorm(l) => format!("model.layers.{l}.self_attn.k_norm"),
            FfnNorm(l) => format!("model.layers.{l}.post_attention_layernorm"),
            Gate(l) => format!("model.layers.{l}.mlp.gate_proj"),
            Up(l) => format!("model.layers.{l}.mlp.up_proj"),
            Down(l) => format!("model.layers.{l}.mlp.down_proj"),
        }
    }

    /// The Hugging Face tensor name.
    pub fn hf(self) -> String {
        use TensorKey::*;
        let suffix = match self {
            QBias(_) | KBias(_) | VBias(_) => "bias",
            _ => "weight",
        };
        format!("{}.{suffix}", self.hf_module())
    }
}
