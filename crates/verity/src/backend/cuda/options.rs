//! The CUDA backend's settings, one typed struct read once: the production defaults, and the knobs that
//! side-by-side measurements turn through `VERITY_CUDA_*` environment variables. None changes a result bit unless
//! its doc says so (the backend's numerics name the ones that do).

use super::{
    ATT_AHEAD_PER_SM, ATT_HEADS, ATT_SPLIT_MAX, MAX_ROWS, NARROW_STREAM, NARROW_WARPS,
    QM_WIDE_TILES, TALL_ROWS, WIDE_WARPS,
};

/// Every setting of a CUDA backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Record short forwards as CUDA graphs and replay them (`VERITY_CUDA_GRAPHS=0`: off).
    pub graphs: bool,
    /// Extra NVRTC options (`VERITY_CUDA_NVRTC`, space-separated): kernel constants tried side by side
    /// (`-DQM_AHEAD=9`), source lines for the profiler (`-lineinfo`), knockouts (`-DKO_*`, `-DLAUNCH_FLOOR`,
    /// which compute garbage by design). These may change bits.
    pub nvrtc: Vec<String>,
    /// Warps of a narrow-schedule CTA (`VERITY_CUDA_NARROW_WARPS`: 4 to 32).
    pub narrow_warps: usize,
    /// Blocks each narrow-schedule warp keeps in flight through shared memory (`VERITY_CUDA_NARROW_STREAM`: 0
    /// to 8; 0 loads them into registers instead).
    pub narrow_stream: usize,
    /// Warps of a wide-schedule CTA (`VERITY_CUDA_WIDE_WARPS`: 4 to 16).
    pub wide_warps: usize,
    /// The tile count from which an integer launch takes the wide schedule (`VERITY_CUDA_WIDE_TILES`: 1 to
    /// 65,536).
    pub wide_tiles: usize,
    /// Int8 tensor-core tiles where the card has them (`VERITY_CUDA_INT8=0`: off; changes bits: the float path
    /// computes in f32).
    pub int8: bool,
    /// Programmatic dependent launch where the card has it (`VERITY_CUDA_PDL=0`: off).
    pub pdl: bool,
    /// RoPE and the cache write fused into the Q/K/V projection (`VERITY_CUDA_FUSE_ROPE=0`: off).
    pub fuse_rope: bool,
    /// Attention blocks that fetch their keys before the grid before finishes (`VERITY_CUDA_ATT_AHEAD=0`: off),
    /// and how many such blocks per SM (`VERITY_CUDA_ATT_AHEAD_PER_SM`: 1 to 64).
    pub att_ahead: bool,
    pub att_ahead_per_sm: usize,
    /// A batched forward's decoding sequences share their RoPE and attention launches
    /// (`VERITY_CUDA_SEQ_LAUNCHES=0`: a launch of each per sequence).
    pub seq_launches: bool,
    /// A fixed attention split over the context (`VERITY_CUDA_ATT_SPLIT`: 1 to `ATT_SPLIT_MAX`), else the rule.
    pub att_split: Option<usize>,
    /// A fixed count of heads per attention block (`VERITY_CUDA_ATT_HEADS`: 1 to `ATT_HEADS`), else the rule.
    pub att_heads: Option<usize>,
    /// The attention split follows the context, not the rows alone (`VERITY_CUDA_ATT_SPLIT_BY_CONTEXT=0`: off).
    pub att_split_by_context: bool,
    /// Attention launches of at least this many rows take a warp per 64-slot chunk (`attention_warps_*`)
    /// instead of a block per chunk, whatever the model's width (`VERITY_CUDA_ATT_WARP_ROWS`: 1 to `MAX_ROWS`,
    /// or 0: never); `None`: the rule (`ATT_WARP_ROWS` rows of models `ATT_WARP_WIDTH` wide). The same bits
    /// either way.
    pub att_warp_rows: Option<usize>,
    /// A fixed count of row groups per projection launch (`VERITY_CUDA_ROW_GROUPS`: 1 to `MAX_ROWS`).
    pub row_groups: Option<usize>,
    /// Multi-row launches split into row groups (`VERITY_CUDA_SPLIT_ROWS=0`: off).
    pub split_rows: bool,
    /// Narrow launches (or row groups) of 8 rows or fewer take the narrow kernel built for one MMA n-tile
    /// (`qmatmuls_narrow8`: half the chains' registers, no spills; `VERITY_CUDA_NARROW8=0`: the 16-row kernel).
    /// The same bits either way; the 8B one-row step on an H100 4.95 vs 5.26 ms, 1B 1.16 vs 1.22.
    pub narrow8: bool,
    /// Launches of more than `MAX_ROWS` rows (prefill chunks) take the tall schedule, every weight read once for
    /// up to `TALL_ROWS` rows, where admitted (`VERITY_CUDA_TALL=0`: off; they run in launches of `MAX_ROWS`).
    pub tall: bool,
    /// Of those, launches whose GEMM grid (`geometry::GEMM_WARPS` tiles a CTA) has at least `gemm_ctas` CTAs
    /// take the GEMM schedule where admitted (`VERITY_CUDA_GEMM=0`: never; `VERITY_CUDA_GEMM_CTAS`: 1 to 65,536,
    /// else the device's SM count). The same bits either way.
    pub gemm: bool,
    pub gemm_ctas: Option<usize>,
    /// Rows per prefill forward (`VERITY_CUDA_PREFILL_ROWS`: 16 to `TALL_ROWS`, by default `TALL_ROWS`: each
    /// weight read once per 256 prompt rows, and grids wide enough for the GEMM schedule at 1B; a forward's
    /// projections run launches of up to `TALL_ROWS` rows, its attention launches of up to `ATT_ROWS`). The same
    /// bits either way.
    pub prefill_rows: usize,
}

impl Default for CudaOptions {
    /// The production settings.
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            nvrtc: Vec::new(),
            narrow_warps: NARROW_WARPS,
            narrow_stream: NARROW_STREAM,
            wide_warps: WIDE_WARPS,
            wide_tiles: QM_WIDE_TILES,
            int8: true,
            pdl: true,
            fuse_rope: true,
            att_ahead: true,
            att_ahead_per_sm: ATT_AHEAD_PER_SM,
            seq_launches: true,
            att_split: None,
            att_heads: None,
            att_split_by_context: true,
            att_warp_rows: None,
            row_groups: None,
            split_rows: true,
            narrow8: true,
            tall: true,
            gemm: true,
            gemm_ctas: None,
            prefill_rows: TALL_ROWS,
        }
    }
}

impl CudaOptions {
    /// The settings the process environment asks for.
    pub fn from_env() -> Self {
        Self::parse(|name| std::env::var(name).ok())
    }

    /// The settings a lookup of `VERITY_CUDA_*` variables asks for: a switch is off only at `0`, a count is
    /// taken only when it parses and lies in its range (otherwise the default stands).
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Self {
        let on = |name: &str| var(name).as_deref() != Some("0");
        let count = |name: &str, range: std::ops::RangeInclusive<usize>| -> Option<usize> {
            let n = var(name)?.trim().parse().ok()?;
            range.contains(&n).then_some(n)
        };
        let d = CudaOptions::default();
        CudaOptions {
            graphs: on("VERITY_CUDA_GRAPHS"),
            nvrtc: var("VERITY_CUDA_NVRTC")
                .map(|o| o.split_whitespace().map(String::from).collect())
                .unwrap_or_default(),
            narrow_warps: count("VERITY_CUDA_NARROW_WARPS", 4..=32).unwrap_or(d.narrow_warps),
            narrow_stream: count("VERITY_CUDA_NARROW_STREAM", 0..=8).unwrap_or(d.narrow_stream),
            wide_warps: count("VERITY_CUDA_WIDE_WARPS", 4..=16).unwrap_or(d.wide_warps),
            wide_tiles: count("VERITY_CUDA_WIDE_TILES", 1..=65_536).unwrap_or(d.wide_tiles),
            int8: on("VERITY_CUDA_INT8"),
            pdl: on("VERITY_CUDA_PDL"),
            fuse_rope: on("VERITY_CUDA_FUSE_ROPE"),
            att_ahead: on("VERITY_CUDA_ATT_AHEAD"),
            att_ahead_per_sm: count("VERITY_CUDA_ATT_AHEAD_PER_SM", 1..=64)
                .unwrap_or(d.att_ahead_per_sm),
            seq_launches: on("VERITY_CUDA_SEQ_LAUNCHES"),
            att_split: count("VERITY_CUDA_ATT_SPLIT", 1..=ATT_SPLIT_MAX),
            att_heads: count("VERITY_CUDA_ATT_HEADS", 1..=ATT_HEADS),
            att_split_by_context: on("VERITY_CUDA_ATT_SPLIT_BY_CONTEXT"),
            att_warp_rows: count("VERITY_CUDA_ATT_WARP_ROWS", 0..=MAX_ROWS),
            row_groups: count("VERITY_CUDA_ROW_GROUPS", 1..=MAX_ROWS),
            split_rows: on("VERITY_CUDA_SPLIT_ROWS"),
            narrow8: on("VERITY_CUDA_NARROW8"),
            tall: on("VERITY_CUDA_TALL"),
            gemm: on("VERITY_CUDA_GEMM"),
            gemm_ctas: count("VERITY_CUDA_GEMM_CTAS", 1..=65_536),
            prefill_rows: count("VERITY_CUDA_PREFILL_ROWS", 16..=TALL_ROWS)
                .unwrap_or(d.prefill_rows),
        }
    }

    /// Whether a knockout is compiled in: it computes garbage by design, so no shape's admission check could
    /// pass; under one every shape is admitted and the W-row launches are timed as they would run.
    pub fn knockout(&self) -> bool {
        self.nvrtc
            .iter()
            .any(|o| o.starts_with("-DKO_") || o == "-DLAUNCH_FLOOR")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> CudaOptions {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        CudaOptions::parse(|name| vars.get(name).cloned())
    }

    #[test]
    fn nothing_set_is_the_production_default() {
        assert_eq!(parse(&[]), CudaOptions::default());
        assert!(!CudaOptions::default().knockout());
    }

    #[test]
    fn switches_turn_off_only_at_zero_and_counts_only_in_range() {
        let o = parse(&[
            ("VERITY_CUDA_GRAPHS", "0"),
            ("VERITY_CUDA_PDL", "no"),
            ("VERITY_CUDA_WIDE_WARPS", "8"),
            ("VERITY_CUDA_NARROW_WARPS", "64"),
            ("VERITY_CUDA_WIDE_TILES", "x"),
            ("VERITY_CUDA_ATT_SPLIT", "0"),
            ("VERITY_CUDA_ROW_GROUPS", "3"),
        ]);
        assert!(!o.graphs && o.pdl, "only 0 turns a switch off");
        assert_eq!(o.wide_warps, 8);
        assert_eq!(
            (o.narrow_warps, o.wide_tiles),
            (NARROW_WARPS, QM_WIDE_TILES),
            "out of range or not a number"
        );
        assert_eq!((o.att_split, o.row_groups), (None, Some(3)));
        assert!(o.seq_launches);
        assert!(!parse(&[("VERITY_CUDA_SEQ_LAUNCHES", "0")]).seq_launches);
    }

    #[test]
    fn nvrtc_options_split_on_whitespace_and_knockouts_are_recognized() {
        let o = parse(&[("VERITY_CUDA_NVRTC", " -DQM_AHEAD=9  -lineinfo ")]);
        assert_eq!(o.nvrtc, vec!["-DQM_AHEAD=9", "-lineinfo"]);
        assert!(!o.knockout());
        assert!(parse(&[("VERITY_CUDA_NVRTC", "-DKO_ATT")]).knockout());
        assert!(parse(&[("VERITY_CUDA_NVRTC", "-DLAUNCH_FLOOR")]).knockout());
    }
}
