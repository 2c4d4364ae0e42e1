//! The kernel module: `kernels.cu` behind the type tags' definitions, compiled by NVRTC for the device's
//! architecture (or read from the PTX cache), and its functions.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::geometry::GEMM_SHARED_BYTES;
use super::{options::CudaOptions, ptx_cache, types, ATT_HEADS, ATT_ROWS};
use crate::error::{Error, Result};

/// The source's path from the repository root, where a profiler run there finds it (`-lineinfo`).
const SOURCE_PATH: &str = "crates/verity/src/backend/cuda/kernels.cu";

/// `kernels.cu` behind the type tags' definitions (`types.rs`), its lines numbered as in the file.
pub(super) fn source() -> String {
    format!(
        "{}#line 1 \"{SOURCE_PATH}\"\n{}",
        types::defines(),
        include_str!("kernels.cu")
    )
}
/// The kernels, loaded from the module compiled for the device.
pub(super) struct Kernels {
    pub(super) matmuls: CudaFunction,
    pub(super) qmatmuls_narrow: CudaFunction,
    pub(super) qmatmuls_narrow8: CudaFunction,
    pub(super) qmatmuls_wide: CudaFunction,
    pub(super) qmatmuls_tall: CudaFunction,
    pub(super) qmatmuls_gemm: CudaFunction,
    pub(super) quantize_x: CudaFunction,
    pub(super) embed: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) rms_norm_add: CudaFunction,
    pub(super) scale: CudaFunction,
    pub(super) rope_and_cache: CudaFunction,
    /// `rope_and_cache` of several sequences in one launch.
    pub(super) rope_and_cache_seqs: CudaFunction,
    /// Attention for blocks of 1 ..= ATT_HEADS query heads (index: heads - 1), without and with the early load.
    pub(super) attention: Vec<CudaFunction>,
    pub(super) attention_ahead: Vec<CudaFunction>,
    /// The same for several sequences in one launch (`attention_seqs_*`, `attention_seqs_ahead_*`).
    pub(super) attention_seqs: Vec<CudaFunction>,
    pub(super) attention_seqs_ahead: Vec<CudaFunction>,
    /// Attention with a warp per chunk (`attention_warps_*`), by heads per block then dims per lane: index
    /// (heads - 1) * 4 + log2(dims per lane), dims per lane 1, 2, 4 or 8.
    pub(super) attention_warps: Vec<CudaFunction>,
    pub(super) add_bias: CudaFunction,
    pub(super) argmax_rows: CudaFunction,
    pub(super) draft_token: CudaFunction,
}

impl Kernels {
    /// The kernels compiled for `arch` with `options` (see [`load_module`]).
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        arch: &'static str,
        options: Vec<String>,
    ) -> Result<Kernels> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("CUDA {what}: {e}"));
        let module = load_module(ctx, arch, options)?;
        let f = |n: &str| module.load_function(n).map_err(|e| err(n, &e));
        Ok(Kernels {
            matmuls: f("matmuls")?,
            qmatmuls_narrow: f("qmatmuls_narrow")?,
            qmatmuls_narrow8: f("qmatmuls_narrow8")?,
            qmatmuls_wide: f("qmatmuls_wide")?,
            qmatmuls_tall: f("qmatmuls_tall")?,
            qmatmuls_gemm: f("qmatmuls_gemm")?,
            quantize_x: f("quantize_x")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rms_norm_add: f("rms_norm_add")?,
            scale: f("scale")?,
            rope_and_cache: f("rope_and_cache")?,
            rope_and_cache_seqs: f("rope_and_cache_seqs")?,
            attention: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_{h}")))
                .collect::<Result<_>>()?,
            attention_ahead: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_ahead_{h}")))
                .collect::<Result<_>>()?,
            attention_seqs: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_seqs_{h}")))
                .collect::<Result<_>>()?,
            attention_seqs_ahead: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_seqs_ahead_{h}")))
                .collect::<Result<_>>()?,
            attention_warps: (1..=ATT_HEADS)
                .flat_map(|h| [1, 2, 4, 8].map(|d| (h, d)))
                .map(|(h, d)| f(&format!("attention_warps_{h}_{d}")))
                .collect::<Result<_>>()?,
            add_bias: f("add_bias")?,
            argmax_rows: f("argmax_rows")?,
            draft_token: f("draft_token")?,
        })
    }
}

/// The NVRTC options `opts` compile the kernels with: its extra ones, then the CTA warp counts and the narrow
/// schedule's stream depth.
pub(super) fn nvrtc_options(opts: &CudaOptions) -> Vec<String> {
    let mut options = opts.nvrtc.clone();
    options.push(format!("-DQM_WARPS={}", opts.wide_warps));
    options.push(format!("-DNQ_WARPS={}", opts.narrow_warps));
    options.push(format!("-DNQ_STREAM={}", opts.narrow_stream));
    options.push(format!("-DRUNS={}", crate::backend::INT8_RUNS));
    options.push(format!("-DGM_SHARED_BYTES={GEMM_SHARED_BYTES}"));
    options.push(format!("-DATT_ROWS={ATT_ROWS}"));
    options
}

/// NVRTC's version, as `nvrtc MAJOR.MINOR`.
pub(super) fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked before any backend is made) and writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("nvrtc {major}.{minor}")
}

/// The kernels compiled for `arch` with `options` and loaded: the PTX comes from verity's cache folder when an
/// earlier run compiled the same source the same way (`ptx_cache`), else from NVRTC. A cached PTX the driver
/// refuses (a driver older than the one that ran before, say) is compiled afresh and replaced.
fn load_module(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
    options: Vec<String>,
) -> Result<Arc<CudaModule>> {
    let err = |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("CUDA {what}: {e}"));
    let nvrtc = nvrtc_version();
    let joined = options.join(" ");
    let source = source();
    let key = ptx_cache::key(&[&source, arch, &joined, &nvrtc, env!("CARGO_PKG_VERSION")]);
    let compile = || {
        compile_ptx_with_opts(
            &source,
            CompileOptions {
                arch: Some(arch),
                options: options.clone(),
                name: Some(SOURCE_PATH.into()),
                ..Default::default()
            },
        )
        .map(|ptx| ptx.to_src())
        .map_err(|e| err("kernel compilation", &e))
    };
    let dir = crate::storage::cache_dir().ok();
    let (ptx, cached) = ptx_cache::get_or_compile(dir.as_deref(), key, compile)?;
    match ctx.load_module(Ptx::from_src(ptx)) {
        Ok(module) => Ok(module),
        Err(e) if cached => {
            tracing::warn!("the cached CUDA kernels did not load ({e}); compiling them again");
            let ptx = compile()?;
            if let Some(d) = &dir {
                let _ = ptx_cache::write(&ptx_cache::path(d, key), &ptx);
            }
            ctx.load_module(Ptx::from_src(ptx))
                .map_err(|e| err("module", &e))
        }
        Err(e) => Err(err("module", &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kernels.cu` compiles, as the backend compiles it, for the tensor-core architectures (sm_80: int8 MMA;
    /// sm_90: also programmatic dependent launch). Needs only NVRTC, no GPU: CI installs NVIDIA's NVRTC wheel
    /// and sets `VERITY_REQUIRE_NVRTC=1`, so a kernel source that does not compile fails there.
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                std::env::var_os("VERITY_REQUIRE_NVRTC").is_none(),
                "VERITY_REQUIRE_NVRTC is set, but no NVRTC library (libnvrtc) can be loaded"
            );
            eprintln!("no NVRTC library: the kernels' compilation is not checked here");
            return;
        }
        for arch in ["compute_80", "compute_90"] {
            let options = cudarc::nvrtc::CompileOptions {
                arch: Some(arch),
                options: nvrtc_options(&CudaOptions::default()),
                ..Default::default()
            };
            if let Err(e) = cudarc::nvrtc::compile_ptx_with_opts(source(), options) {
                panic!("kernels.cu does not compile for {arch}: {e}");
            }
        }
    }
}
