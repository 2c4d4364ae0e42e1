//! The CUDA backend (feature `cuda`): CUDA C kernels (`kernels.cu`) compiled by NVRTC at load for the card's
//! architecture, launched through the driver loaded at run time — so the build needs no CUDA toolkit, and a
//! machine without a GPU gets a clear error instead of a link failure (`module.rs`). The compiled PTX is kept in the cache
//! folder (`ptx_cache.rs`): NVRTC takes tens of seconds for `kernels.cu`, paid once per source, options and
//! toolkit instead of at every start.
//!
//! Projections (`projections.rs`), two kernels:
//! - the GGML block formats with integer kernels on sm_80+ (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and
//!   Q3_K as Q6_K; `qmatmuls_narrow`, `qmatmuls_wide`): weights repacked at upload into tensor-core tiles
//!   (`tiles.rs`), x quantized to 8 bits per 32-value block, each block's integer dot product from an int8 MMA
//!   (Q6_K: one per 16-value half), then per (column, row) the blocks accumulated in index order — operation
//!   for operation the CPU backend's 8-bit contract, so a row's result is bitwise the CPU's, and one MMA serves
//!   8 rows, so a W-row verify costs little more than a one-row step. x is quantized once per launch
//!   (`quantize_x`, with the fused RMS norm) into a buffer every CTA reads, so no CTA repeats that work and any
//!   row length runs. Prefill forwards (256 rows: `CudaOptions::prefill_rows`) take the tall schedule
//!   (`qmatmuls_tall`: a CTA per tile and row group of up to 64 rows, its warps each streaming a run of the
//!   tile's blocks over all its rows) or, where the grid has CTAs enough, the GEMM schedule (`qmatmuls_gemm`:
//!   a CTA of 8 tiles staging x once for all of them through a pipeline of shared-memory stages) — every
//!   schedule the same arithmetic per (column, row).
//! - every other format (F32, F16, BF16, Q2_K, the IQ4 grids, MLX affine; and launches mixing tiled and untiled
//!   matrices) (`matmuls`): f32 activations staged in shared memory, a warp per output column whose lanes
//!   decode each weight block once and apply it to every staged row, each row's sums in a fixed order.
//!
//! Row-exactness: in both kernels a row's arithmetic never depends on the rows beside it; a fused RMS norm
//! computes each row exactly as the `rms_norm` kernel does; attention, RoPE and norms are per row, with every
//! slot's place in every sum fixed by the slot alone. So a W-row verify gives each row bitwise the one-row
//! step's result on this backend.
//!
//! Admission: the W-row projection kernel is checked once per weight shape at load, on the real weights,
//! against the one-row kernel (bitwise, for each row-count variant); a shape that fails runs its verifies one
//! row per launch.
//!
//! Launch overhead: a decode step is ~150 small kernels, so launching them one by one costs more than running
//! some of them. Every op reads its per-forward inputs (tokens, positions, first slot, mask) from a
//! device-resident step written by one copy, so a forward is recorded once as a CUDA graph per key (width,
//! buffers) and replayed. On sm_90 every launch carries programmatic dependent launch (`launch.rs`): a kernel's
//! blocks start while the one before runs and prefetch their weights, then wait for its results. Fusions: the
//! Q/K/V projections with their input norm, RoPE and the cache write in one launch (the integer kernel's
//! epilogue; the angles come with the step, `rope.rs`), the gate/up projections with their norm and the SwiGLU
//! in one, the final norm with the output projection, and the output projections adding into the residual
//! stream. With graphs and PDL the launches' own cost is a small part of a forward (a forward whose kernels
//! return at once, `-DLAUNCH_FLOOR`, takes a fraction of a real one): what remains is the kernels' bodies — by
//! knockouts (`-DKO_STAGE`, `-DKO_ATT`) the projections' quantization of x, and attention.
//!
//! Attention (`attention.rs`) is split over 64-slot chunks (a block per chunk of the cache's capacity, of which as many work as
//! the step's context has chunks; fewer blocks, each taking chunks in turn, where a wave would not hold them)
//! and combined in chunk order by the block that finishes last, so its parallelism grows with the context while
//! every sum keeps a fixed order. Its first chunk of committed K/V is loaded before it waits for the Q/K/V
//! launch (only the new slots depend on it). Where a block per (row, head, chunk) would crowd the SMs (wide
//! verifies, long contexts), a block serves all the query heads of a KV head (`att_heads`), loading each K and
//! V value once for them. Launches of many rows (prefill chunks, wide verifies) take a warp per chunk instead
//! (`attention_warps_*`): the same records by the same arithmetic, with no block barrier inside a chunk.
//!
//! MLX-affine weights are re-laid at upload into 32-value blocks with f32 scale and bias (`affine.rs`) and run
//! the f32-activation kernel, decoding bitwise as the CPU does.
//!
//! Not yet: split-K GEMM launches for the narrow matrices of a prefill chunk, integer kernels for F16/BF16, the
//! IQ4 grids, Q2_K and MLX affine (they run the f32-activation kernel), a persistent per-layer kernel.
//!
//! Faults: the `Backend` operations cannot fail, so a driver error after load is kept as the backend's fault,
//! the launches after it are skipped, and the forward returns it as its error (`Backend::take_fault`): the
//! request sees it and the process goes on. Only an allocation the device cannot satisfy still panics. A graph
//! recording the driver breaks off (work outside it, such as another thread freeing memory, invalidates a
//! capture) is no fault: the forward runs unrecorded.

pub mod affine;
mod attention;
mod geometry;
mod launch;
mod module;
mod options;
mod projections;
mod ptx_cache;
mod recorded;
mod rope;
pub mod tiles;
mod types;
mod views;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    CUdevice_attribute, CUfunction_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchConfig};

use launch::{addr, Arg};
pub use options::CudaOptions;
use recorded::Recorded;
use rope::{RopeKey, RopeTable};
use views::{views_bytes, write_views};

use crate::backend::RopeStyle;
use crate::backend::{
    AttnMask, AttnShape, Backend, Glu, HeadNorms, Rope, SeqAttention, StepInputs,
};
use crate::error::{Error, Result};
use crate::quant::QMatrix;
use module::{nvrtc_options, nvrtc_version, source, Kernels};
use projections::{Admitted, RopeFusion};

/// Rows per projection launch (longer batches run in chunks), and per attention launch in a block per chunk.
const MAX_ROWS: usize = 16;
/// Rows per tall or GEMM projection launch (prefill chunks: `kernels.cu`'s `qmatmuls_tall`, `qmatmuls_gemm`),
/// and per CTA of one (8 MMA n-tiles): a launch of more rows than a CTA takes has row groups.
const TALL_ROWS: usize = 256;
const TALL_CTA_ROWS: usize = 64;
/// Rows per attention launch with a warp per chunk (`kernels.cu`'s `ATT_ROWS`): a 64-row prefill chunk in one
/// launch, so its warps fill the SMs where 16 rows' left most of them idle; the attention scratch holds records
/// for this many rows.
const ATT_ROWS: usize = 64;

/// The float projection kernel's warps per block (`kernels.cu`'s `matmuls`); what every projection kernel keeps
/// back from the dynamic shared memory for its static shared memory (a bound: `matmuls` uses 32 bytes,
/// `qmatmuls_*` none). The rest of the projections' geometry is `geometry.rs`.
const MM_WARPS: usize = 8;
const MATMUL_STATIC_BYTES: usize = 256 * 4;
/// Matrices with at least this many output columns give each warp 4 columns (fewer blocks staging x).
const WIDE_COLUMNS: usize = 16_384;
/// The tile count from which an integer launch gives each warp its own tile (the wide schedule).
const QM_WIDE_TILES: usize = WIDE_COLUMNS / tiles::TILE_ROWS;
/// Warps (tiles) of a wide-schedule CTA (`kernels.cu`'s `QM_WARPS`).
const WIDE_WARPS: usize = 16;
/// Warps of a narrow-schedule CTA (`kernels.cu`'s `NQ_WARPS`): 16 beat 8 at one row and 24 at 4 to 16 rows, at
/// every size measured (BENCHMARKS.md, "Real model sizes on the GPU").
const NARROW_WARPS: usize = 16;
/// Blocks each narrow-schedule warp keeps in flight through shared memory (`kernels.cu`'s `NQ_STREAM`; 0: into
/// registers, `NQ_AHEAD` at a time).
const NARROW_STREAM: usize = 0;
/// Bytes of one such block's slot (`kernels.cu`'s `STREAM_SLOT`).
const STREAM_SLOT: usize = 640;
/// The fewest rows a row group split off a launch of 8 rows or fewer takes (`projections.rs`'s `row_groups`).
const GROUP_ROWS_MIN: usize = 4;
/// The attention kernel's slots per chunk, blocks per (row, head) (the default split) and largest head
/// (`kernels.cu`).
const ATT_CHUNK: usize = 64;
const ATT_SPLIT: usize = 8;
const ATT_SPLIT_MAX: usize = 32;
/// The most query heads one attention block serves (`kernels.cu`'s `ATT_KERNELS`).
const ATT_HEADS: usize = 4;
/// Attention launches of at least this many rows, of models whose query heads span at least this many values,
/// run with a warp per chunk (`kernels.cu`'s `attention_warps_*`, `ATT_WARPS` warps a block). Measured against a
/// block per chunk (BENCHMARKS.md, "Real model sizes on the GPU"): faster for 16-row launches at the 1B and 8B
/// shapes (prefill chunks, 16-row verifies), slower for fewer rows over short contexts and at SmolLM2's shape
/// (9 heads of 64), where a launch has too few warps' worth of work.
const ATT_WARP_ROWS: usize = 16;
const ATT_WARP_WIDTH: usize = 2048;
const ATT_WARPS: usize = 4;
/// Blocks of the plain attention kernel resident on an SM (46-62 registers × 256 threads, by heads per block;
/// beside others' CTAs).
const ATT_RESIDENT_PER_SM: usize = 4;
/// Attention grids of up to this many blocks per SM run the early-load variant (78-88 registers: 2-3 per SM
/// alone, so a grid of 4 per SM runs in two waves at most). Four rather than two: the early loads still pay over
/// two waves, faster at 8 rows and the same at other widths (measured: BENCHMARKS.md, "Verify cost by width").
const ATT_AHEAD_PER_SM: usize = 4;
/// Blocks per row of the argmax kernel (`kernels.cu`'s `argmax_rows`).
const ARGMAX_PARTS: usize = 16;
const MAX_HEAD_DIM: usize = 256;
/// Recorded forwards kept; the least recently replayed is dropped beyond this (`recorded.rs`). Every engine
/// on the backend records into one store: a 4-route benchmark holds ~80, more with caches of several
/// capacities (their buffers are part of the keys).
const MAX_GRAPHS: usize = 512;

/// A weight matrix on the device, in its GGML block format or (Q4_0, Q4_1, Q8_0 on sm_80+) in tiles.
pub struct CudaMatrix {
    /// `kernels.cu`'s type tag (the tiled forms have their own).
    ty: i32,
    /// The tensor-core tile form the matrix is stored in, if any.
    form: Option<tiles::Form>,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
    /// Rows one projection launch may take: `MAX_ROWS`, or fewer where staging them would exceed the shared
    /// memory, once the W-row kernel was admitted for this shape (bitwise equal to the one-row kernel on these
    /// weights); else 1.
    launch_rows: usize,
    /// Launches of more than `MAX_ROWS` rows take the tall schedule (admitted for this shape, bitwise equal
    /// to the one-row kernel).
    tall: bool,
    /// They may take the GEMM schedule instead (admitted likewise).
    gemm: bool,
}

/// One forward's inputs on the device, one upload per step. Layout (`kernels.cu`'s `read_step`): a 16-byte
/// header {base, rows, tree, views offset}, `cap` tokens, `cap` positions, then per prepared rotation its rows'
/// `(cos, sin)` pairs (`cap` × `head_dim` f32), then under a tree mask each row's view of the step's rows
/// ([`write_views`]).
pub struct CudaStep {
    cap: usize,
    /// Per prepared rotation: its key and the f32 offset of its rows' table.
    ropes: Vec<(RopeKey, usize)>,
    mask_at: usize,
    host: Vec<u8>,
    dev: CudaSlice<u8>,
}

/// The graphs are only touched under the backend's mutex, from one thread at a time.
struct GraphStore(Mutex<Recorded<CudaGraph>>);
// SAFETY: a `CudaGraph` holds driver handles that must not be used concurrently; the mutex serialises every use.
unsafe impl Send for GraphStore {}
// SAFETY: as above.
unsafe impl Sync for GraphStore {}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    name: String,
    /// [`Backend::numerics`]: the architecture, the kernels' source, compiler and options, and the int8 route.
    numerics: String,
    /// `None`: every forward launches its kernels one by one (`VERITY_CUDA_GRAPHS=0`, and the tests' reference).
    graphs: Option<GraphStore>,
    /// Dynamic shared memory the projection kernels may stage their rows of x in.
    matmul_shared: usize,
    /// Tensor-core int8 MMA (sm_80+, unless `VERITY_CUDA_INT8=0`): Q4_0/Q4_1/Q8_0 are tiled and run
    /// `qmatmuls_*`.
    int8_tiles: bool,
    /// Programmatic dependent launch on every launch (sm_90+, unless `VERITY_CUDA_PDL=0`).
    pdl: bool,
    /// RoPE and the cache write fused into the Q/K/V projection where it can be (`VERITY_CUDA_FUSE_ROPE=0`:
    /// never, for side-by-side measurements).
    fuse_rope: bool,
    /// Attention loads its first chunk of committed K and V before waiting for the grid before, where its grid
    /// is small (`VERITY_CUDA_ATT_AHEAD=0`: never, for side-by-side measurements).
    att_ahead: bool,
    /// The largest attention grid, in blocks per SM, that runs the early-load variant (`ATT_AHEAD_PER_SM`;
    /// for side-by-side measurements `VERITY_CUDA_ATT_AHEAD_PER_SM`).
    att_ahead_per_sm: usize,
    /// A batched forward's decoding sequences share RoPE and attention launches (`VERITY_CUDA_SEQ_LAUNCHES=0`:
    /// a launch of each per sequence, for side-by-side measurements).
    seq_launches: bool,
    /// Warps of a narrow-schedule projection CTA (`kernels.cu`'s `NQ_WARPS`, set at compilation).
    narrow_warps: usize,
    /// Shared memory of a narrow-schedule CTA's weight stream (`NQ_STREAM` slots per warp).
    narrow_stream_bytes: usize,
    /// Warps (tiles) of a wide-schedule projection CTA (`kernels.cu`'s `QM_WARPS`, set at compilation).
    wide_warps: usize,
    /// The tile count from which an integer launch takes the wide schedule (`QM_WIDE_TILES`; for
    /// side-by-side measurements `VERITY_CUDA_WIDE_TILES`).
    wide_tiles: usize,
    /// Attention blocks per (row, head) forced by `VERITY_CUDA_ATT_SPLIT` (side-by-side measurements); `None`:
    /// [`CudaBackend::att_split`]'s rule.
    att_split: Option<usize>,
    /// Query heads per attention block forced by `VERITY_CUDA_ATT_HEADS` (1: a block per head; side-by-side
    /// measurements, up to ATT_HEADS); `None`: [`att_heads`]'s rule.
    att_heads: Option<usize>,
    /// The split sized by the cache's capacity (`att_split`; `VERITY_CUDA_ATT_SPLIT_BY_CONTEXT=0`: by the row
    /// count alone, for side-by-side measurements).
    att_split_by_context: bool,
    /// Attention launches of at least this many rows take a warp per chunk at any width (0: none), forced by
    /// `VERITY_CUDA_ATT_WARP_ROWS` (side-by-side measurements, tests); `None`: `ATT_WARP_ROWS` and
    /// `ATT_WARP_WIDTH`.
    att_warp_rows: Option<usize>,
    /// Row groups per narrow launch forced by `VERITY_CUDA_ROW_GROUPS` (1: none; side-by-side measurements);
    /// `None`: [`CudaBackend::row_groups`]'s rule.
    row_groups: Option<usize>,
    /// Narrow launches of 8 rows or fewer split their rows in two groups where [`CudaBackend::row_groups`]'s
    /// rule says so (`VERITY_CUDA_SPLIT_ROWS=0`: never, for side-by-side measurements).
    split_rows: bool,
    /// Narrow launches of 8 rows or fewer take `qmatmuls_narrow8` (`CudaOptions::narrow8`).
    narrow8: bool,
    /// Launches of more than `MAX_ROWS` rows take the tall schedule where admitted (`VERITY_CUDA_TALL=0`: never,
    /// for side-by-side measurements).
    tall: bool,
    /// Of those, launches with CTAs enough take the GEMM schedule where admitted (`CudaOptions::gemm`,
    /// `CudaOptions::gemm_ctas`).
    gemm: bool,
    gemm_ctas: Option<usize>,
    /// Rows per prefill forward (`Backend::prefill_rows`, `CudaOptions::prefill_rows`).
    prefill_rows: usize,
    /// `quantize_x`'s output, read by the integer projections (the last is current; see [`StagedX`]).
    staged: Mutex<Vec<StagedX>>,
    /// The rows the last launch staged for the projection that comes next (`rms_norm_add` told of it, or the
    /// attention's output); cleared by every other launch or copy, so a projection only skips its own staging
    /// right after (see [`StagedFor`]).
    staged_for: Mutex<Option<StagedFor>>,
    /// The argmax kernel's per-row records and counters (`Backend::argmax`).
    argmax_work: CudaSlice<f32>,
    /// Streaming multiprocessors of the device.
    sms: usize,
    /// The admission verdict per weight shape (type, rows, cols): rows per launch, and whether the tall
    /// schedule is admitted.
    admitted: Mutex<HashMap<(i32, usize, usize), Admitted>>,
    /// Compiled with a knockout (measurements only): every shape admitted unchecked.
    knockout: bool,
    /// Rotations prepared at load (`prepare_attention`), in the order of every step's tables.
    ropes: Mutex<Vec<RopeTable>>,
    /// The first driver error since the model last took it (`Backend::take_fault`). Once set, launches and
    /// copies are skipped (their results would be garbage) until it is taken, and no graph recorded meanwhile
    /// is kept.
    fault: Mutex<Option<String>>,
    /// The next launch fails as a driver error would (`fail_next_launch`).
    fail_next: std::sync::atomic::AtomicBool,
    /// A forward is being recorded (`replay_or_record`), and whether the driver has broken the recording off:
    /// a capture is invalidated by work outside it (another thread synchronizing the device, freeing memory),
    /// not by the forward, so the forward then runs unrecorded instead of failing.
    capturing: std::sync::atomic::AtomicBool,
    capture_broken: std::sync::atomic::AtomicBool,
    /// The next recording is broken off as the driver would (`break_next_capture`).
    break_next: std::sync::atomic::AtomicBool,
}

/// Whether `e` reports a stream capture broken off by the driver rather than a failed operation.
fn capture_broken_off(e: &cudarc::driver::DriverError) -> bool {
    use cudarc::driver::sys::CUresult as R;
    matches!(
        e.0,
        R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
    )
}

/// The integer projections' quantized input (`kernels.cu`'s `quantize_x`): `STAGED_ROWS` rows of `k` bytes,
/// and per row `k / 32` scales and sums. Sized at load for the longest tiled row; a longer one loaded later gets
/// a new buffer and the old one is kept, since recorded forwards still address it.
struct StagedX {
    k: usize,
    xq: CudaSlice<u8>,
    xd: CudaSlice<f32>,
    xs: CudaSlice<f32>,
}

/// What a `StagedX` holds after a launch staged the projection input that comes next (`rms_norm_add` told of
/// it, or the attention's output for the output projection): rows `0..rows` of the buffer at `x` (rows of `k`
/// values), through the norm at `norm` with `eps` (0 and 0: none), in the `StagedX` of index `buffer`. A
/// projection launch of exactly those finds it and skips `quantize_x`.
#[derive(Clone, Copy, PartialEq, Debug)]
struct StagedFor {
    x: u64,
    rows: usize,
    k: usize,
    norm: u64,
    eps: u32,
    buffer: usize,
}

/// Rows of a `StagedX`: a launch's rows, and those its row groups read past them (a group pads its rows to a
/// multiple of 8 — narrow: to 8 or 16 — and starts fewer rows in than the launch has).
const STAGED_ROWS: usize = TALL_ROWS + 8;

/// A mutex's guard, also after a panic elsewhere (the guarded tables stay consistent: every update is one push
/// or insert).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaStep {
    /// The f32 offset in the step of the rows' `(cos, sin)` table of `rope` for heads of `head_dim`.
    fn rope_table(&self, rope: Rope, head_dim: usize) -> i32 {
        let key = rope::key(rope, head_dim);
        let at = self.ropes.iter().find(|(k, _)| *k == key).map(|t| t.1);
        at.expect(
            "a rotation prepared at load (Backend::prepare_attention) before the step was made",
        ) as i32
    }
}

/// An allocation's result: memory the device cannot give is the one driver error a `Backend` operation cannot
/// turn into a fault (it has no buffer to return), so it panics with the driver's message.
fn dev<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what}: {e}"))
}

fn grid(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block).max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Open GPU `ordinal` with the settings the environment asks for ([`CudaOptions::from_env`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, CudaOptions::from_env())
    }

    /// Open GPU `ordinal` and compile the kernels for it, with `opts`.
    pub fn with_options(ordinal: usize, opts: CudaOptions) -> Result<Self> {
        let graphs = opts.graphs;
        let err =
            |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("CUDA {what}: {e}"));
        // cudarc panics on its first call into a library it cannot load; ask first, so a machine without the
        // driver or NVRTC gets an error it can act on.
        // SAFETY: each only tries to open the library (and closes it again).
        let (driver, nvrtc) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
            )
        };
        if !driver {
            return Err(Error::Unsupported(
                "CUDA: no NVIDIA driver library (libcuda) found on this machine".into(),
            ));
        }
        if !nvrtc {
            return Err(Error::Unsupported(
                "CUDA: no NVRTC library (libnvrtc, the CUDA runtime compiler) found: install the CUDA toolkit's \
                 NVRTC or put it on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| err("device", &e))?;
        // One stream orders everything, so cudarc's per-buffer events are not needed (and must not be recorded
        // into a graph).
        // SAFETY: no buffer exists yet, and the backend uses a single stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| err("device", &e))?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let (narrow_warps, wide_warps, knockout) =
            (opts.narrow_warps, opts.wide_warps, opts.knockout());
        let options = nvrtc_options(&opts);
        // The warp and load-ahead counts change no bit (`rowexact` under each); other options may (a knockout,
        // a constant).
        let bit_options: Vec<&str> = options
            .iter()
            .map(String::as_str)
            .filter(|o| {
                ![
                    "-DQM_WARPS=",
                    "-DNQ_WARPS=",
                    "-DQM_AHEAD=",
                    "-DNQ_AHEAD=",
                    "-DNQ_STREAM=",
                ]
                .iter()
                .any(|p| o.starts_with(p))
            })
            .collect();
        let kernels_numerics = format!(
            "{arch} {} kernels {:016x} options [{}]",
            nvrtc_version(),
            ptx_cache::key(&[&source()]),
            bit_options.join(" ")
        );
        let k = Kernels::load(&ctx, arch, options)?;
        let optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| err("device", &e))? as usize;
        let matmul_shared = optin.saturating_sub(MATMUL_STATIC_BYTES);
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("device", &e))? as usize;
        for f in [
            &k.matmuls,
            &k.qmatmuls_narrow,
            &k.qmatmuls_narrow8,
            &k.qmatmuls_wide,
            &k.qmatmuls_tall,
            &k.qmatmuls_gemm,
        ] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                matmul_shared as i32,
            )
            .map_err(|e| err("shared memory", &e))?;
        }
        let int8_tiles = major >= 8 && opts.int8;
        let pdl = major >= 9 && opts.pdl;
        let name = format!(
            "cuda:{ordinal} ({}, sm_{major}{minor}{}{}{})",
            ctx.name().unwrap_or_default(),
            if graphs { ", graphs" } else { "" },
            if pdl { ", PDL" } else { "" },
            if int8_tiles { ", int8 MMA" } else { "" },
        );
        // Graph capture needs a stream other than the legacy default one.
        let stream = ctx.new_stream().map_err(|e| err("stream", &e))?;
        let argmax_work = stream
            .alloc_zeros::<f32>(MAX_ROWS * (2 * ARGMAX_PARTS + 1))
            .map_err(|e| err("alloc", &e))?;
        Ok(CudaBackend {
            ctx,
            stream,
            k,
            name,
            // Graphs, PDL, the fusions, the attention split and the row groups change no bit (module doc).
            numerics: format!(
                "cuda {kernels_numerics} int8 {}",
                if int8_tiles { "MMA" } else { "off" }
            ),
            graphs: graphs.then(|| GraphStore(Mutex::new(Recorded::new(MAX_GRAPHS)))),
            matmul_shared,
            int8_tiles,
            pdl,
            fuse_rope: opts.fuse_rope,
            att_ahead: opts.att_ahead,
            att_ahead_per_sm: opts.att_ahead_per_sm,
            seq_launches: opts.seq_launches,
            narrow_warps,
            narrow_stream_bytes: narrow_warps * opts.narrow_stream * STREAM_SLOT,
            wide_warps,
            wide_tiles: opts.wide_tiles,
            att_split: opts.att_split,
            att_heads: opts.att_heads,
            att_split_by_context: opts.att_split_by_context,
            att_warp_rows: opts.att_warp_rows,
            row_groups: opts.row_groups,
            split_rows: opts.split_rows,
            narrow8: opts.narrow8,
            tall: opts.tall,
            gemm: opts.gemm,
            gemm_ctas: opts.gemm_ctas,
            prefill_rows: opts.prefill_rows,
            argmax_work,
            staged: Mutex::new(Vec::new()),
            staged_for: Mutex::new(None),
            sms,
            admitted: Mutex::new(HashMap::new()),
            knockout,
            ropes: Mutex::new(Vec::new()),
            fault: Mutex::new(None),
            fail_next: std::sync::atomic::AtomicBool::new(false),
            capturing: std::sync::atomic::AtomicBool::new(false),
            capture_broken: std::sync::atomic::AtomicBool::new(false),
            break_next: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Launch `f` (with programmatic dependent launch where the device has it); a driver error becomes the
    /// fault, and after a fault nothing is launched.
    ///
    /// # Safety
    /// As [`launch::launch`]: `args` match the kernel's signature and every address is valid for its accesses.
    unsafe fn go(&self, what: &str, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) {
        // Whatever this launch writes, a projection input staged ahead is no longer known to be current.
        *lock(&self.staged_for) = None;
        if self.faulted() {
            return;
        }
        let r = match self.injected() {
            Some(e) => Err(e),
            // SAFETY: the caller's contract.
            None => unsafe { launch::launch(&self.stream, f, cfg, self.pdl, args) },
        };
        self.check(what, r);
    }

    /// The launch failure `fail_next_launch` asked for, once.
    fn injected(&self) -> Option<cudarc::driver::DriverError> {
        self.fail_next
            .swap(false, std::sync::atomic::Ordering::Relaxed)
            .then_some(cudarc::driver::DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
            ))
    }

    /// Makes the next kernel or graph launch fail as a driver error would: the fault path's test
    /// (`tests/cuda.rs`) drives it on a real device; nothing else calls it.
    #[doc(hidden)]
    pub fn fail_next_launch(&self) {
        self.fail_next
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes the next graph recording end broken off, as the driver breaks one off when work outside it
    /// interferes: the recovery's test (`tests/cuda.rs`) drives it on a real device; nothing else calls it.
    #[doc(hidden)]
    pub fn break_next_capture(&self) {
        self.break_next
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// `r`'s value, or `None` with its error kept as the fault (the first one since the fault was last taken).
    fn check<T>(
        &self,
        what: &str,
        r: std::result::Result<T, cudarc::driver::DriverError>,
    ) -> Option<T> {
        use std::sync::atomic::Ordering::Relaxed;
        r.map_err(|e| {
            if self.capturing.load(Relaxed) && capture_broken_off(&e) {
                self.capture_broken.store(true, Relaxed);
                return;
            }
            let mut fault = lock(&self.fault);
            if fault.is_none() {
                tracing::error!("CUDA {what}: {e}");
                *fault = Some(format!("CUDA {what}: {e}"));
            }
        })
        .ok()
    }

    fn faulted(&self) -> bool {
        lock(&self.fault).is_some()
    }

    fn at<T>(&self, s: &CudaSlice<T>, at: usize) -> Arg<'static> {
        addr(&self.stream, s, at)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaSlice<f32>;
    type Matrix = CudaMatrix;
    type Step = CudaStep;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn numerics(&self) -> String {
        self.numerics.clone()
    }

    fn load_matrix(&self, m: QMatrix) -> Result<CudaMatrix> {
        self.upload_matrix(m)
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        m.data.len()
    }

    fn buffer(&self, len: usize) -> CudaSlice<f32> {
        dev("alloc", self.stream.alloc_zeros::<f32>(len.max(1)))
    }

    fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        if data.is_empty() {
            return self.buffer(1);
        }
        dev("upload", self.stream.clone_htod(data))
    }

    fn write(&self, buf: &mut CudaSlice<f32>, data: &[f32]) {
        *lock(&self.staged_for) = None;
        let r = self
            .stream
            .memcpy_htod(data, &mut buf.slice_mut(..data.len()));
        self.check("upload", r);
    }

    fn download(&self, buf: &CudaSlice<f32>, len: usize) -> Vec<f32> {
        let r = self.stream.clone_dtoh(&buf.slice(..len));
        self.check("download", r).unwrap_or_else(|| vec![0.0; len])
    }

    fn take_fault(&self) -> Option<String> {
        lock(&self.fault).take()
    }

    fn step(&self, max_rows: usize) -> CudaStep {
        let mut at = 16 + 8 * max_rows;
        let ropes = lock(&self.ropes)
            .iter()
            .map(|t| {
                let table = (t.key, at / 4);
                at += 4 * max_rows * t.key.1;
                table
            })
            .collect();
        let bytes = at + views_bytes(max_rows);
        CudaStep {
            cap: max_rows,
            ropes,
            mask_at: at,
            host: vec![0; bytes],
            dev: dev("alloc", self.stream.alloc_zeros::<u8>(bytes)),
        }
    }

    fn set_step(&self, step: &mut CudaStep, inputs: StepInputs) {
        let (cap, rows) = (step.cap, inputs.tokens.len());
        assert!(
            rows <= cap && inputs.positions.len() == rows,
            "{rows} rows in a step of {cap}"
        );
        let tree = match inputs.mask {
            AttnMask::Causal => None,
            AttnMask::Tree(v) => Some(v),
        };
        let h = &mut step.host;
        let mut put = |at: usize, v: [u8; 4]| h[at..at + 4].copy_from_slice(&v);
        put(0, (inputs.base as i32).to_le_bytes());
        put(4, (rows as i32).to_le_bytes());
        put(8, i32::from(tree.is_some()).to_le_bytes());
        put(12, (step.mask_at as i32).to_le_bytes());
        for (r, (&t, &p)) in inputs.tokens.iter().zip(inputs.positions).enumerate() {
            put(16 + 4 * r, (t as i32).to_le_bytes());
            put(16 + 4 * (cap + r), (p as i32).to_le_bytes());
        }
        let mut used = 16 + 8 * cap;
        let mut tables = lock(&self.ropes);
        for (key, at) in &step.ropes {
            let table = tables
                .iter_mut()
                .find(|t| t.key == *key)
                .expect("a step's rotations stay prepared");
            for (r, &p) in inputs.positions.iter().enumerate() {
                // An image's row at multimodal positions takes its pairs from their sections' positions.
                let row = match inputs.spatial.get(r) {
                    Some(&[h, w]) if [h, w] != [p, p] => Cow::Owned(table.at_multimodal([p, h, w])),
                    _ => Cow::Borrowed(table.at(p)),
                };
                for (i, v) in row.iter().enumerate() {
                    put(4 * (at + r * key.1 + i), v.to_le_bytes());
                }
            }
            used = 4 * (at + rows * key.1);
        }
        if let Some(v) = tree {
            used = step.mask_at + write_views(v, rows, &mut h[step.mask_at..]);
        }
        let r = self
            .stream
            .memcpy_htod(&step.host[..used], &mut step.dev.slice_mut(..used));
        self.check("step upload", r);
    }

    fn replay_or_record(&self, key: u64, work: &mut dyn FnMut()) {
        let Some(store) = &self.graphs else {
            return work();
        };
        if self.faulted() {
            return work(); // launches nothing, records nothing
        }
        let mut g = lock(&store.0);
        if let Some(graph) = g.replay(key) {
            let r = match self.injected() {
                Some(e) => Err(e),
                None => graph.launch(),
            };
            self.check("graph launch", r);
            return;
        }
        use std::sync::atomic::Ordering::Relaxed;
        let r = self
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        if self.check("graph capture", r).is_none() {
            return;
        }
        self.capturing.store(true, Relaxed);
        work();
        if self.break_next.swap(false, Relaxed) {
            self.capture_broken.store(true, Relaxed);
        }
        let r = self.stream.end_capture(CUgraphInstantiate_flags(0));
        let r = self.check("graph capture", r);
        self.capturing.store(false, Relaxed);
        if self.capture_broken.swap(false, Relaxed) {
            // Nothing of the broken recording ran: the forward runs as launches, to be recorded next time.
            tracing::debug!(
                "CUDA graph capture broken off by the driver: the forward runs unrecorded"
            );
            return work();
        }
        let Some(graph) = r.flatten() else {
            return;
        };
        if self.faulted() {
            return; // a launch failed while recording: the graph misses it, so it is dropped unplayed
        }
        let r = g.insert(key, graph).launch();
        self.check("graph launch", r);
        let s = g.stats();
        tracing::debug!(
            "CUDA graph recorded: {} kept, {} recorded, {} evicted, {} replays so far",
            g.len(),
            s.recordings,
            s.evictions,
            s.replays
        );
    }

    fn embed(&self, table: &CudaMatrix, step: &CudaStep, rows: usize, out: &mut CudaSlice<f32>) {
        let (ty, k, cap) = (table.ty, table.cols as i32, step.cap as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            self.at(&table.data, 0),
            Arg::I32(ty),
            Arg::I32(k),
            Arg::I32(tiles::tiles(table.rows) as i32),
            self.at(&step.dev, 0),
            Arg::I32(cap),
            self.at(out, 0),
        ];
        // SAFETY: argument types and sizes match the kernel's signature; out holds rows × k values; the step's
        // tokens were checked against the vocabulary by the model.
        unsafe { self.go("embed", &self.k.embed, cfg, &args) };
    }

    fn matmul(&self, w: &CudaMatrix, x: &CudaSlice<f32>, rows: usize, out: &mut CudaSlice<f32>) {
        self.matmuls_chunked(x, None, rows, false, None, &[w], &mut [out], None);
    }

    fn matmul_add(
        &self,
        w: &CudaMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.matmuls_chunked(x, None, rows, true, None, &[w], &mut [out], None);
    }

    fn matmuls(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        rows: usize,
        outs: &mut [(&CudaMatrix, &mut CudaSlice<f32>)],
    ) {
        for chunk in outs.chunks_mut(3) {
            let mats: Vec<&CudaMatrix> = chunk.iter().map(|(w, _)| *w).collect();
            let mut bufs: Vec<&mut CudaSlice<f32>> =
                chunk.iter_mut().map(|(_, o)| &mut **o).collect();
            self.matmuls_chunked(x, norm, rows, false, None, &mats, &mut bufs, None);
        }
    }

    fn glu_matmul(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        rows: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        act: Glu,
        out: &mut CudaSlice<f32>,
    ) {
        assert_eq!(gate.rows, up.rows, "gate and up projections of one width");
        self.matmuls_chunked(
            x,
            norm,
            rows,
            false,
            Some(act),
            &[gate, up],
            &mut [out],
            None,
        );
    }

    fn scale(&self, x: &mut CudaSlice<f32>, len: usize, s: f32) {
        let args = [self.at(x, 0), Arg::F32(s), Arg::I32(len as i32)];
        // SAFETY: x holds at least len values; one thread per value.
        unsafe { self.go("scale", &self.k.scale, grid(len, 256), &args) };
    }

    fn rms_norm_add(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
        next: Option<(&CudaSlice<f32>, f32)>,
    ) {
        self.launch_rms_norm_add(x, w, rows, dim, eps, out, next);
    }

    fn qkv_rope_and_cache(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        mats: [&CudaMatrix; 3],
        [q, k, v]: [&mut CudaSlice<f32>; 3],
        [k_cache, v_cache]: [&mut CudaSlice<f32>; 2],
        shape: AttnShape,
        rope: Rope,
        step: &CudaStep,
    ) {
        // Fused where a tile never splits a rotated pair (interleaved pairs, an even head size) and the
        // projections run the narrow integer schedule, whose epilogue holds a column and its neighbour in
        // neighbouring threads (as the tall schedule, its many-row form, does; not the wide one); not for local
        // layers, whose cache may be a ring.
        let n_tiles: usize = mats.iter().map(|m| tiles::tiles(m.rows)).sum();
        let fused = self.fuse_rope
            && rope.dims.is_none()
            && mats.iter().all(|m| m.form.is_some())
            && n_tiles < self.wide_tiles
            && rope.style == RopeStyle::Interleaved
            && shape.window.is_none()
            && shape.head_dim.is_multiple_of(2)
            && mats[0].rows == shape.n_heads * shape.head_dim
            && mats[1].rows == shape.n_kv_heads * shape.head_dim
            && mats[2].rows == mats[1].rows;
        if !fused {
            self.matmuls(
                x,
                norm,
                shape.rows,
                &mut [(mats[0], &mut *q), (mats[1], &mut *k), (mats[2], &mut *v)],
            );
            self.rope_and_cache(q, k, v, k_cache, v_cache, shape, rope, None, step);
            return;
        }
        let fusion = RopeFusion {
            table: step.rope_table(rope, shape.head_dim),
            head_dim: shape.head_dim,
            k_cache,
            v_cache,
            step,
        };
        self.matmuls_chunked(
            x,
            norm,
            shape.rows,
            false,
            None,
            &mats,
            &mut [q, k, v],
            Some(&fusion),
        );
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize, dim: usize) {
        let (d, n) = (dim as i32, (rows * dim) as i32);
        let args = [self.at(x, 0), self.at(bias, 0), Arg::I32(d), Arg::I32(n)];
        // SAFETY: x holds rows × dim values, bias dim.
        unsafe { self.go("add_bias", &self.k.add_bias, grid(rows * dim, 256), &args) };
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) {
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (dim / 32 * 4) as u32,
        };
        let args = [
            self.at(x, 0),
            self.at(w, 0),
            Arg::I32(dim as i32),
            Arg::F32(eps),
            self.at(out, 0),
        ];
        // SAFETY: x and out hold rows × dim values, w dim.
        unsafe { self.go("rms_norm", &self.k.rms_norm, cfg, &args) };
    }

    fn rope_and_cache(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<f32>,
        v_cache: &mut CudaSlice<f32>,
        shape: AttnShape,
        rope: Rope,
        norms: Option<HeadNorms<'_, CudaSlice<f32>>>,
        step: &CudaStep,
    ) {
        let (rows, hd) = (shape.rows, shape.head_dim);
        let warps = rows * (shape.n_heads + 2 * shape.n_kv_heads);
        let args = [
            self.at(q, 0),
            self.at(k, 0),
            self.at(v, 0),
            self.at(k_cache, 0),
            self.at(v_cache, 0),
            Arg::I32(rows as i32),
            Arg::I32(shape.n_heads as i32),
            Arg::I32(shape.n_kv_heads as i32),
            Arg::I32(hd as i32),
            Arg::I32(rope.rotated(hd) as i32),
            Arg::I32(step.rope_table(rope, hd)),
            Arg::I32(i32::from(rope.style == RopeStyle::Interleaved)),
            self.at(&step.dev, 0),
            Arg::I32(step.cap as i32),
            Arg::I32((k_cache.len() / (shape.n_kv_heads * hd)) as i32),
            norms.map_or(Arg::Ptr(0), |n| self.at(n.q, 0)),
            norms.map_or(Arg::Ptr(0), |n| self.at(n.k, 0)),
            Arg::F32(norms.map_or(0.0, |n| n.eps)),
        ];
        // SAFETY: q holds rows × n_heads × head_dim values, k and v rows × kv_dim, the norms' weights head_dim
        // each, the caches room for the step's slots (reserved by the model; a ring's slots wrap); one warp per
        // (row, head) of Q, K and V.
        unsafe {
            self.go(
                "rope_and_cache",
                &self.k.rope_and_cache,
                grid(warps * 32, 128),
                &args,
            )
        };
    }

    fn attention_seqs(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rope: Rope,
        norms: Option<HeadNorms<'_, CudaSlice<f32>>>,
        seqs: &mut [SeqAttention<'_, Self>],
    ) -> bool {
        self.launch_attention_seqs(q, k, v, out, rope, norms, seqs)
    }

    fn prepare_attention(&self, head_dim: usize, rope: Rope) -> Result<()> {
        if head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(2) {
            return Err(Error::Unsupported(format!(
                "heads of {head_dim} values on the CUDA backend (its attention runs even sizes up to \
                 {MAX_HEAD_DIM})"
            )));
        }
        let key = rope::key(rope, head_dim);
        let mut tables = lock(&self.ropes);
        if !tables.iter().any(|t| t.key == key) {
            tables.push(RopeTable::new(rope, head_dim));
        }
        Ok(())
    }

    fn prefill_rows(&self) -> usize {
        self.prefill_rows
    }

    fn f32_row_multiple(&self) -> usize {
        32 // the kernels read rows in 32-value blocks
    }

    fn attention_work_len(&self, n_heads: usize, head_dim: usize, capacity: usize) -> usize {
        let per_row_head = 1 + capacity.div_ceil(ATT_CHUNK) * (head_dim + 2);
        ATT_ROWS * n_heads * per_row_head
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        work: &mut CudaSlice<f32>,
        shape: AttnShape,
        step: &CudaStep,
        out: &mut CudaSlice<f32>,
    ) {
        self.launch_attention(q, k_cache, v_cache, work, shape, step, out);
    }

    fn argmax(&self, x: &CudaSlice<f32>, rows: usize, n: usize, out: &mut CudaSlice<f32>) {
        let counters = MAX_ROWS * 2 * ARGMAX_PARTS;
        for r0 in (0..rows).step_by(MAX_ROWS) {
            let take = (rows - r0).min(MAX_ROWS);
            let args = [
                self.at(x, r0 * n),
                Arg::I32(n as i32),
                self.at(out, r0),
                self.at(&self.argmax_work, 0),
                self.at(&self.argmax_work, counters),
            ];
            let cfg = LaunchConfig {
                grid_dim: (take as u32, ARGMAX_PARTS as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x holds rows × n values, out rows; `argmax_work` holds MAX_ROWS rows of records and then
            // MAX_ROWS counters, zero between launches (the kernel's last block per row resets its counter).
            unsafe { self.go("argmax", &self.k.argmax_rows, cfg, &args) };
        }
    }

    fn draft_token(
        &self,
        src: &CudaSlice<f32>,
        table: Option<&CudaSlice<f32>>,
        log: &mut CudaSlice<f32>,
        at: usize,
        step: Option<&mut CudaStep>,
    ) {
        assert!(at < log.len(), "draft log of {} values", log.len());
        let args = [
            self.at(src, 0),
            table.map_or(Arg::Ptr(0), |t| self.at(t, 0)),
            self.at(log, at),
            // The step's first token: after its 16-byte header (`set_step`).
            step.map_or(Arg::Ptr(0), |s| self.at(&s.dev, 16)),
        ];
        // SAFETY: src holds an argmax index below the table's length (the draft vocabulary's), log `at + 1`
        // values (checked), a step at least one token after its header.
        unsafe { self.go("draft token", &self.k.draft_token, grid(1, 32), &args) };
    }

    fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        len: usize,
    ) {
        if len == 0 {
            return;
        }
        *lock(&self.staged_for) = None;
        let s = src.slice(src_off..src_off + len);
        let mut d = dst.slice_mut(dst_off..dst_off + len);
        let r = self.stream.memcpy_dtod(&s, &mut d);
        self.check("copy", r);
    }

    fn copy_within(&self, buf: &mut CudaSlice<f32>, src_off: usize, dst_off: usize, len: usize) {
        assert!(
            dst_off + len <= src_off || src_off + len <= dst_off,
            "copy_within ranges overlap"
        );
        if len == 0 {
            return;
        }
        *lock(&self.staged_for) = None;
        let r = if dst_off < src_off {
            let (mut lo, hi) = buf.split_at_mut(src_off);
            let s = hi.slice(0..len);
            let mut d = lo.slice_mut(dst_off..dst_off + len);
            self.stream.memcpy_dtod(&s, &mut d)
        } else {
            let (lo, mut hi) = buf.split_at_mut(dst_off);
            let s = lo.slice(src_off..src_off + len);
            let mut d = hi.slice_mut(0..len);
            self.stream.memcpy_dtod(&s, &mut d)
        };
        self.check("copy", r);
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::CudaBackend;

    #[test]
    fn a_machine_without_the_driver_gets_an_error_instead_of_a_panic() {
        // SAFETY: only opens the library and closes it again.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            return; // a GPU machine: the backend's own tests (tests/cuda.rs) run there
        }
        let e = CudaBackend::new(0).err().expect("no driver, no backend");
        assert!(e.to_string().contains("libcuda"), "{e}");
    }
}
