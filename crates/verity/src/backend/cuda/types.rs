//! The weight type tags `kernels.cu` dispatches on, in one table: the host passes a matrix's tag with every
//! launch, and the kernel source is compiled behind a `#define T_<NAME> <tag>` line per row of the same table,
//! so the two sides cannot disagree.

use super::tiles::Form;
use crate::quant::GgmlType;

/// A kernel type tag: how a matrix's bytes are laid out on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// GGML blocks as stored.
    Ggml(GgmlType),
    /// Repacked into tensor-core tiles (`tiles.rs`).
    Tiled(Form),
    /// MLX affine of 4 or 8 bits, re-laid into 32-value blocks (`affine.rs`).
    Affine4,
    Affine8,
}

/// Every tag with its name in the kernel source and its value.
const TABLE: &[(Tag, &str)] = &[
    (Tag::Ggml(GgmlType::F32), "F32"),
    (Tag::Ggml(GgmlType::F16), "F16"),
    (Tag::Ggml(GgmlType::BF16), "BF16"),
    (Tag::Ggml(GgmlType::Q4_0), "Q4_0"),
    (Tag::Ggml(GgmlType::Q4_1), "Q4_1"),
    (Tag::Ggml(GgmlType::Q8_0), "Q8_0"),
    (Tag::Ggml(GgmlType::Q4K), "Q4_K"),
    (Tag::Ggml(GgmlType::Q5K), "Q5_K"),
    (Tag::Ggml(GgmlType::Q6K), "Q6_K"),
    (Tag::Tiled(Form::Q4_0), "TQ4_0"),
    (Tag::Tiled(Form::Q4_1), "TQ4_1"),
    (Tag::Tiled(Form::Q8_0), "TQ8_0"),
    (Tag::Affine4, "AFF4"),
    (Tag::Affine8, "AFF8"),
    (Tag::Ggml(GgmlType::Q5_0), "Q5_0"),
    (Tag::Ggml(GgmlType::Q5_1), "Q5_1"),
    (Tag::Ggml(GgmlType::IQ4NL), "IQ4_NL"),
    (Tag::Ggml(GgmlType::IQ4XS), "IQ4_XS"),
    (Tag::Ggml(GgmlType::Q2K), "Q2_K"),
    (Tag::Ggml(GgmlType::Q3K), "Q3_K"),
    (Tag::Tiled(Form::Q5_0), "TQ5_0"),
    (Tag::Tiled(Form::Q5_1), "TQ5_1"),
    (Tag::Tiled(Form::Q4K), "TQ4_K"),
    (Tag::Tiled(Form::Q5K), "TQ5_K"),
    (Tag::Tiled(Form::Q6K), "TQ6_K"),
];

impl Tag {
    /// The value the kernels see (the tag's row in the table).
    pub fn value(self) -> i32 {
        TABLE
            .iter()
            .position(|&(t, _)| t == self)
            .expect("every tag has a row") as i32
    }
}

/// The `#define` lines the kernel source is compiled behind.
pub fn defines() -> String {
    TABLE
        .iter()
        .enumerate()
        .map(|(i, (_, name))| format!("#define T_{name} {i}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ggml_type_and_tiled_form_has_one_tag() {
        let ggml = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::IQ4NL,
            GgmlType::IQ4XS,
        ];
        for ty in ggml {
            let tag = Tag::Ggml(ty);
            assert_eq!(
                TABLE.iter().filter(|&&(t, _)| t == tag).count(),
                1,
                "{ty:?}"
            );
            if let Some(form) = Form::of(ty) {
                assert_ne!(Tag::Tiled(form).value(), tag.value());
            }
        }
        let names: std::collections::HashSet<_> = TABLE.iter().map(|(_, n)| n).collect();
        assert_eq!(names.len(), TABLE.len());
        assert!(defines().contains("#define T_TQ6_K 24\n"));
    }
}
