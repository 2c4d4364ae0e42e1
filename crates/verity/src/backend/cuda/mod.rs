//! The CUDA backend (feature `cuda`): CUDA C kernels (`kernels.cu`) compiled by NVRTC at load for the card's
//! architecture, launched through the driver loaded at run time — so the build needs no CUDA toolkit, and a
//! machine without a GPU gets a clear error instead of a link failure. The compiled PTX is kept in the cache
//! folder (`ptx_cache.rs`): NVRTC takes tens of seconds for `kernels.cu`, paid once per source, options and
//! toolkit instead of at every start.
//!
//! Projections, two kernels:
//! - Q4_0, Q4_1 and Q8_0 on sm_80+ (`qmatmuls_narrow`, `qmatmuls_wide`): weights repacked at upload into
//!   tensor-core tiles (`tiles.rs`), x quantized to 8 bits per 32-value block, each block's integer dot product
//!   from an int8 MMA, then per (column, row) the blocks accumulated in index order — operation for operation
//!   the CPU backend's 8-bit contract, so a row's result is bitwise the CPU's, and one MMA serves 8 rows, so a
//!   W-row verify costs little more than a one-row step.
//! - every other format (F32, F16, BF16, the K-quants; and groups mixing kinds) (`matmuls`): f32 activations
//!   staged in shared memory, a warp per output column whose lanes decode each weight block once and apply it
//!   to every staged row, each row's sums in a fixed order.
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
//! knockouts (`-DKO_STAGE`, `-DKO_ATT`, `-DKO_CHAIN`) chiefly the staging of x into the projections and
//! attention, then the per-(column, row) chains.
//!
//! Attention is split over 64-slot chunks (a block per chunk of the cache's capacity, of which as many work as
//! the step's context has chunks; fewer blocks, each taking chunks in turn, where a wave would not hold them)
//! and combined in chunk order by the block that finishes last, so its parallelism grows with the context while
//! every sum keeps a fixed order. Its first chunk of committed K/V is loaded before it waits for the Q/K/V
//! launch (only the new slots depend on it). Where a block per (row, head, chunk) would crowd the SMs (wide
//! verifies, long contexts), a block serves all the query heads of a KV head (`att_heads`), loading each K and
//! V value once for them.
//!
//! MLX-affine weights are re-laid at upload into 32-value blocks with f32 scale and bias (`affine.rs`) and run
//! the f32-activation kernel, decoding bitwise as the CPU does.
//!
//! Not yet: a tiled GEMM for long prefills (they run 16 rows per launch), integer kernels for the K-quants and
//! MLX affine (they run the f32-activation kernel), a persistent per-layer kernel. The `Backend` operations
//! cannot fail, so a device error after load panics with the driver's message.

pub mod affine;
mod geometry;
mod launch;
mod options;
mod ptx_cache;
mod recorded;
mod rope;
pub mod tiles;
mod types;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    CUdevice_attribute, CUfunction_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, LaunchConfig,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use launch::{addr, Arg};
pub use options::CudaOptions;
use recorded::Recorded;
use rope::{RopeKey, RopeTable};

use crate::backend::RopeStyle;
use crate::backend::{AttnMask, AttnShape, Backend, Rope, StepInputs};
use crate::error::{Error, Result};
use crate::quant::{QMatrix, WeightFormat};
use geometry::{q_geometry, staged_bytes, QGeometry, QMats, ROWS_PER_GROUP};
use types::Tag;

/// The source's path from the repository root, where a profiler run there finds it (`-lineinfo`).
const SOURCE_PATH: &str = "crates/verity/src/backend/cuda/kernels.cu";

/// `kernels.cu` behind the type tags' definitions (`types.rs`), its lines numbered as in the file.
fn source() -> String {
    format!(
        "{}#line 1 \"{SOURCE_PATH}\"\n{}",
        types::defines(),
        include_str!("kernels.cu")
    )
}
/// Rows per projection launch (longer batches run in chunks), and per attention launch.
const MAX_ROWS: usize = 16;
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
/// Warps of a narrow-schedule CTA (`kernels.cu`'s `NQ_WARPS` and `NQ_WARPS_ROWS`): for launches of fewer than
/// `NARROW_ROWS_FROM` rows, and for the others.
const NARROW_WARPS: usize = 16;
const NARROW_WARPS_ROWS: usize = 24;
const NARROW_ROWS_FROM: usize = 4;
/// The attention kernel's slots per chunk, blocks per (row, head) (the default split) and largest head
/// (`kernels.cu`).
const ATT_CHUNK: usize = 64;
const ATT_SPLIT: usize = 8;
const ATT_SPLIT_MAX: usize = 32;
/// The most query heads one attention block serves (`kernels.cu`'s `ATT_KERNELS`).
const ATT_HEADS: usize = 4;
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
}

/// A forward's inputs on the device, laid out as `kernels.cu`'s `Step` reads them: an i32 header {base, rows,
/// tree, 0}, u32 tokens[cap], i32 positions[cap], u8 mask[cap²].
/// One forward's inputs on the device, one upload per step. Layout (`kernels.cu`'s `read_step`): a 16-byte
/// header {base, rows, tree, mask offset}, `cap` tokens, `cap` positions, then per prepared rotation its rows'
/// `(cos, sin)` pairs (`cap` × `head_dim` f32), then the `cap` × `cap` tree mask.
pub struct CudaStep {
    cap: usize,
    /// Per prepared rotation: its key and the f32 offset of its rows' table.
    ropes: Vec<(RopeKey, usize)>,
    mask_at: usize,
    host: Vec<u8>,
    dev: CudaSlice<u8>,
}

struct Kernels {
    matmuls: CudaFunction,
    qmatmuls_narrow: CudaFunction,
    qmatmuls_narrow_rows: CudaFunction,
    qmatmuls_wide: CudaFunction,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope_and_cache: CudaFunction,
    /// Attention for blocks of 1 ..= ATT_HEADS query heads (index: heads - 1), without and with the early load.
    attention: Vec<CudaFunction>,
    attention_ahead: Vec<CudaFunction>,
    add_bias: CudaFunction,
    argmax_rows: CudaFunction,
    draft_token: CudaFunction,
}

/// RoPE and the cache write fused into a Q/K/V launch of the integer kernel (`kernels.cu`'s `RopeFusion`).
struct RopeFusion<'a> {
    /// The step's `(cos, sin)` table (`CudaStep::rope_table`).
    table: i32,
    head_dim: usize,
    k_cache: &'a CudaSlice<f32>,
    v_cache: &'a CudaSlice<f32>,
    step: &'a CudaStep,
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
    /// Warps of a narrow-schedule projection CTA for launches of fewer than `NARROW_ROWS_FROM` rows and for the
    /// others (`kernels.cu`'s `NQ_WARPS`, `NQ_WARPS_ROWS`, set at compilation).
    narrow_warps: [usize; 2],
    /// Warps (tiles) of a wide-schedule projection CTA (`kernels.cu`'s `QM_WARPS`, set at compilation).
    wide_warps: usize,
    /// Attention blocks per (row, head) forced by `VERITY_CUDA_ATT_SPLIT` (side-by-side measurements); `None`:
    /// [`CudaBackend::att_split`]'s rule.
    att_split: Option<usize>,
    /// Query heads per attention block forced by `VERITY_CUDA_ATT_HEADS` (1: a block per head; side-by-side
    /// measurements, up to ATT_HEADS); `None`: [`att_heads`]'s rule.
    att_heads: Option<usize>,
    /// The split sized by the cache's capacity (`att_split`; `VERITY_CUDA_ATT_SPLIT_BY_CONTEXT=0`: by the row
    /// count alone, for side-by-side measurements).
    att_split_by_context: bool,
    /// Row groups per narrow launch forced by `VERITY_CUDA_ROW_GROUPS` (1: none; side-by-side measurements);
    /// `None`: [`CudaBackend::row_groups`]'s rule.
    row_groups: Option<usize>,
    /// Narrow launches of 8 rows or fewer split their rows in two groups where [`CudaBackend::row_groups`]'s
    /// rule says so (`VERITY_CUDA_SPLIT_ROWS=0`: never, for side-by-side measurements).
    split_rows: bool,
    /// x is quantized with eight threads per 32-value block, as before the four- and two-lane staging
    /// (`VERITY_CUDA_STAGE_LANES=8`, for side-by-side measurements).
    eight_lanes: bool,
    /// The argmax kernel's per-row records and counters (`Backend::argmax`).
    argmax_work: CudaSlice<f32>,
    /// Streaming multiprocessors of the device.
    sms: usize,
    /// The admission verdict per weight shape (type, rows, cols): rows per launch.
    admitted: Mutex<HashMap<(i32, usize, usize), usize>>,
    /// Compiled with a knockout (measurements only): every shape admitted unchecked.
    knockout: bool,
    /// Rotations prepared at load (`prepare_attention`), in the order of every step's tables.
    ropes: Mutex<Vec<RopeTable>>,
}

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

fn dev<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what}: {e}"))
}

/// Query heads per attention block for a launch of `rows` rows over a cache of `chunks` 64-slot chunks: one
/// while a block per (row, head, chunk) leaves no SM more than two (`sms`), else the largest divisor of the GQA
/// group (query heads per KV head) up to ATT_HEADS; `forced` (up to ATT_HEADS) replaces the rule. A block of
/// several heads loads each K and V value once for all of them (fewer blocks, a chunk read once per KV head),
/// but its own chain is longer, which costs where the blocks per head fit the GPU anyway: with SmolLM2's groups
/// of 3, a block per group is faster from 4 rows over a short context and from 2 over a long one, a block per
/// head at 1-2 rows over a short one, and a one-chunk context does not care. The rule counts the capacity's
/// chunks (a recorded launch serves every context the cache holds), up to twice the context's: hence two per
/// SM, which picks the faster count, or one within noise of it, at every width and context measured, and
/// makes MTP's verify faster than one per SM does (measured: BENCHMARKS.md, "Verify cost by width"). Every
/// query's arithmetic is the same at any count (the same bits: `rowexact` under each), so the count may follow
/// the rows.
fn att_heads(
    n_heads: usize,
    n_kv_heads: usize,
    rows: usize,
    chunks: usize,
    sms: usize,
    forced: Option<usize>,
) -> usize {
    let group = n_heads / n_kv_heads.max(1);
    let most = match forced {
        Some(f) => f.clamp(1, ATT_HEADS),
        None if rows * n_heads * chunks <= 2 * sms => 1,
        None => ATT_HEADS,
    };
    (1..=most.min(group))
        .rev()
        .find(|h| group.is_multiple_of(*h))
        .unwrap_or(1)
}

/// Row groups of a narrow projection launch of `tiles` CTAs and `rows` rows of `k` values (`threads` per
/// many-row CTA, `sms` on the device), each group's rows a launch of their own (`kernels.cu`'s
/// `qmatmuls_body`). Past 8 rows, where one CTA would pad its rows to 16 (two MMA n-tiles, twice the exchange),
/// as many groups as leave no CTA waiting for an SM, which is faster at 16 rows. At 8 rows or fewer (unless
/// `split_rows` is false), two groups where both CTAs of a tile fit the SMs together, each group keeps the
/// many-row kernel and stages its rows in one pass of four threads per block (shorter staging and chains per
/// CTA), and the launch is not a Q/K/V projection with RoPE fused (attention's blocks start while it runs,
/// loading their first chunk, on the SMs it leaves free). Splitting o and down at 7-8 rows makes 8-row verifies
/// faster and one-row steps no slower; splitting the Q/K/V launch too, or groups of three rows (at 5-6 rows, in
/// the few-row kernel), is slower (measured: BENCHMARKS.md, "Verify cost by width"). No bits depend on it: a
/// (column, row)'s arithmetic is the same in any group (`rowexact`, the admission).
fn row_groups(
    tiles: usize,
    rows: usize,
    k: usize,
    rope: bool,
    sms: usize,
    threads: usize,
    split_rows: bool,
) -> usize {
    let half = rows.div_ceil(2);
    let split = split_rows
        && half >= NARROW_ROWS_FROM
        && half * (k / 32) * 4 <= threads
        && 2 * tiles <= sms
        && !rope;
    let want = if rows > 8 {
        sms / tiles.max(1)
    } else if split {
        2
    } else {
        1
    };
    nonempty_groups(rows, want)
}

/// The groups a launch of `rows` rows in `want` groups has: the kernel gives each group ceil(rows / groups) rows,
/// so as many as that leaves non-empty.
fn nonempty_groups(rows: usize, want: usize) -> usize {
    let per = rows.div_ceil(want.clamp(1, rows.max(1)));
    rows.div_ceil(per)
}

/// The NVRTC options `opts` compile the kernels with: its extra ones, then the CTA warp counts.
fn nvrtc_options(opts: &CudaOptions) -> Vec<String> {
    let mut options = opts.nvrtc.clone();
    options.push(format!("-DQM_WARPS={}", opts.wide_warps));
    options.push(format!("-DNQ_WARPS={}", opts.narrow_warps[0]));
    options.push(format!("-DNQ_WARPS_ROWS={}", opts.narrow_warps[1]));
    options
}

/// NVRTC's version, as `nvrtc MAJOR.MINOR`.
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (checked before any backend is made) and writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("nvrtc {major}.{minor}")
}

/// The kernels compiled for `arch` with `options` and loaded: the PTX comes from verity's cache folder when an
/// earlier run compiled the same source the same way (`ptx_cache`), else from NVRTC. A cached PTX the driver
/// refuses (a driver older than the one that ran before, say) is compiled afresh and replaced.
fn load_kernels(
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
        // The warp counts change no bit (`rowexact` under each); other options may (a knockout, a constant).
        let bit_options: Vec<&str> = options
            .iter()
            .map(String::as_str)
            .filter(|o| !o.starts_with("-DQM_WARPS=") && !o.starts_with("-DNQ_WARPS"))
            .collect();
        let kernels_numerics = format!(
            "{arch} {} kernels {:016x} options [{}]",
            nvrtc_version(),
            ptx_cache::key(&[&source()]),
            bit_options.join(" ")
        );
        let module = load_kernels(&ctx, arch, options)?;
        let f = |n: &str| module.load_function(n).map_err(|e| err(n, &e));
        let k = Kernels {
            matmuls: f("matmuls")?,
            qmatmuls_narrow: f("qmatmuls_narrow")?,
            qmatmuls_narrow_rows: f("qmatmuls_narrow_rows")?,
            qmatmuls_wide: f("qmatmuls_wide")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope_and_cache: f("rope_and_cache")?,
            attention: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_{h}")))
                .collect::<Result<_>>()?,
            attention_ahead: (1..=ATT_HEADS)
                .map(|h| f(&format!("attention_ahead_{h}")))
                .collect::<Result<_>>()?,
            add_bias: f("add_bias")?,
            argmax_rows: f("argmax_rows")?,
            draft_token: f("draft_token")?,
        };
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
            &k.qmatmuls_narrow_rows,
            &k.qmatmuls_wide,
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
            narrow_warps,
            wide_warps,
            att_split: opts.att_split,
            att_heads: opts.att_heads,
            att_split_by_context: opts.att_split_by_context,
            row_groups: opts.row_groups,
            split_rows: opts.split_rows,
            argmax_work,
            eight_lanes: opts.eight_lanes,
            sms,
            admitted: Mutex::new(HashMap::new()),
            knockout,
            ropes: Mutex::new(Vec::new()),
        })
    }

    /// Attention blocks per (row, head) for a launch of `row_heads` (row, head) pairs over a cache of
    /// `capacity` slots: a block per 64-slot chunk of the capacity, so that no block takes two chunks in turn
    /// (the kernel puts only as many blocks to work as the step's context has chunks; the others return at
    /// once), capped where 4 blocks per SM would not hold the grid (at ATT_SPLIT, or more where a wave allows)
    /// and at ATT_SPLIT_MAX. Against the row-count-only rule (the branch with `att_split_by_context` off), each
    /// with its own early-load limit (4 blocks per SM here, 2 there), this one is faster at 4-8 rows over a
    /// 256-slot context and at 2-4 over a 1024-slot one, within noise elsewhere; its one loss is 16 rows over a
    /// one-chunk context (measured: BENCHMARKS.md, "Verify cost by width"). No bits depend on it: every chunk's
    /// record is the same whichever block computes it, and the combine reads them in chunk order.
    fn att_split(&self, row_heads: usize, capacity: usize) -> usize {
        if let Some(forced) = self.att_split {
            return forced;
        }
        if !self.att_split_by_context {
            return if ATT_SPLIT * row_heads < self.sms {
                (2 * self.sms / row_heads).clamp(ATT_SPLIT, ATT_SPLIT_MAX)
            } else {
                ATT_SPLIT
            };
        }
        let wave = ATT_RESIDENT_PER_SM * self.sms / row_heads.max(1);
        capacity
            .div_ceil(ATT_CHUNK)
            .clamp(1, wave.clamp(ATT_SPLIT, ATT_SPLIT_MAX))
    }

    /// Row groups of a narrow projection launch (see [`row_groups`]), or the count `VERITY_CUDA_ROW_GROUPS`
    /// forces.
    fn row_groups(&self, tiles: usize, rows: usize, k: usize, rope: bool) -> usize {
        let threads = self.narrow_warps[1] * 32;
        match self.row_groups {
            Some(forced) => nonempty_groups(rows, forced),
            None => row_groups(tiles, rows, k, rope, self.sms, threads, self.split_rows),
        }
    }

    /// Launch `f` (with programmatic dependent launch where the device has it); a driver error panics.
    ///
    /// # Safety
    /// As [`launch::launch`]: `args` match the kernel's signature and every address is valid for its accesses.
    unsafe fn go(&self, what: &str, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) {
        // SAFETY: the caller's contract.
        dev(what, unsafe {
            launch::launch(&self.stream, f, cfg, self.pdl, args)
        });
    }

    fn at<T>(&self, s: &CudaSlice<T>, at: usize) -> Arg {
        addr(&self.stream, s, at)
    }

    /// One launch of the `matmuls` kernel over up to three matrices that share `x` (`rows` ≤ `MAX_ROWS`, row
    /// offset `r0` into `x` and every output): `outs[m]` receives `mats[m]`'s projection; with `glu`, `mats` are
    /// the gate and up projections and their SwiGLU goes to the one output.
    /// Whether a launch of `mats` runs the integer kernels: every matrix tiled, and gate and up of one type.
    fn int8_launch(glu: bool, mats: &[&CudaMatrix]) -> bool {
        mats.iter().all(|m| m.form.is_some()) && (!glu || mats[0].ty == mats[1].ty)
    }

    /// The most rows the float kernel stages for rows of `k` values (at least 1: a row that does not fit was
    /// refused at load).
    fn float_rows(&self, k: usize) -> usize {
        (1..=MAX_ROWS)
            .rev()
            .find(|&r| staged_bytes(r, k) <= self.matmul_shared)
            .unwrap_or(1)
    }

    /// The geometry of an integer launch of `rows` rows (per CTA) over `mats` (tiled).
    fn q_geometry(
        &self,
        rows: usize,
        k: usize,
        wide: bool,
        glu: bool,
        mats: &[&CudaMatrix],
    ) -> Option<QGeometry> {
        let forms = mats.iter().filter_map(|m| m.form);
        let q = QMats {
            per_tile: if glu { 2 } else { 1 },
            sums: forms.clone().map(|f| f.sums_per_block()).max()?,
            scale_bytes: forms.map(|f| f.scale_bytes(k / 32)).max()?,
        };
        q_geometry(rows, k, wide, q, self.matmul_shared)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_matmuls(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        r0: usize,
        rows: usize,
        accumulate: bool,
        glu: bool,
        mats: &[&CudaMatrix],
        outs: &mut [&mut CudaSlice<f32>],
        rope: Option<&RopeFusion>,
    ) {
        debug_assert!((1..=3).contains(&mats.len()) && rows <= MAX_ROWS);
        debug_assert!(mats.iter().all(|m| rows <= m.launch_rows));
        debug_assert_eq!(outs.len(), if glu { 1 } else { mats.len() });
        let k = mats[0].cols;
        assert!(
            mats.iter().all(|w| w.cols == k),
            "projections of one input must share its width"
        );
        let (acc, glu_i) = (i32::from(accumulate), i32::from(glu));
        let mut args = vec![
            self.at(x, r0 * k),
            Arg::I32(k as i32),
            Arg::I32(rows as i32),
            Arg::I32(acc),
            norm.map_or(Arg::Ptr(0), |(w, _)| self.at(w, 0)),
            Arg::F32(norm.map_or(0.0, |n| n.1)),
            Arg::I32(glu_i),
        ];
        let int8 = Self::int8_launch(glu, mats);
        let (f, cfg) = if int8 {
            let n_tiles: usize = if glu {
                tiles::tiles(mats[0].rows)
            } else {
                mats.iter().map(|m| tiles::tiles(m.rows)).sum()
            };
            // The wide schedule's CTAs may straddle matrices, so it needs them of one type (`kernels.cu`), and
            // it stages whole rows.
            let wide = n_tiles >= QM_WIDE_TILES
                && mats.iter().all(|m| m.ty == mats[0].ty)
                && self.q_geometry(rows, k, true, glu, mats).is_some();
            let (ctas, groups) = if wide {
                (n_tiles.div_ceil(self.wide_warps), 1)
            } else {
                (n_tiles, self.row_groups(n_tiles, rows, k, rope.is_some()))
            };
            // The rows one CTA takes (the kernel's own split).
            let cta_rows = rows.div_ceil(groups);
            let geometry = self
                .q_geometry(cta_rows, k, wide, glu, mats)
                .expect("capped by `launch_rows`");
            args.push(Arg::I32(geometry.chunk as i32));
            args.push(Arg::I32(geometry.window as i32));
            let bytes = geometry.bytes;
            // Both narrow kernels give every (column, row) the same arithmetic: which one a launch takes by its
            // row count changes no bits (the admission crosses them: MAX_ROWS rows against one).
            let (f, warps) = if wide {
                (&self.k.qmatmuls_wide, self.wide_warps)
            } else if cta_rows >= NARROW_ROWS_FROM {
                (&self.k.qmatmuls_narrow_rows, self.narrow_warps[1])
            } else {
                (&self.k.qmatmuls_narrow, self.narrow_warps[0])
            };
            let cfg = LaunchConfig {
                grid_dim: (ctas as u32, groups as u32, 1),
                block_dim: ((warps * 32) as u32, 1, 1),
                shared_mem_bytes: bytes as u32,
            };
            (f, cfg)
        } else {
            let cols: usize = if glu {
                mats[0].rows
            } else {
                mats.iter().map(|w| w.rows).sum()
            };
            let cols_per_warp = if cols >= WIDE_COLUMNS { 4 } else { 1 };
            let staged = staged_bytes(rows, k);
            debug_assert!(staged <= self.matmul_shared, "capped by `launch_rows`");
            args.push(Arg::I32(cols_per_warp as i32));
            let cfg = LaunchConfig {
                grid_dim: (
                    cols.div_ceil(MM_WARPS * cols_per_warp) as u32,
                    rows.div_ceil(ROWS_PER_GROUP) as u32,
                    1,
                ),
                block_dim: ((MM_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: staged as u32,
            };
            (&self.k.matmuls, cfg)
        };
        // Unused matrix slots repeat the first matrix with zero columns and no output.
        let mut outs = outs.iter_mut();
        for m in 0..3 {
            match mats.get(m) {
                Some(w) => {
                    let n = if glu { mats[0].rows } else { w.rows };
                    let out = if glu && m > 0 { None } else { outs.next() };
                    args.extend([
                        self.at(&w.data, 0),
                        Arg::I32(w.ty),
                        Arg::I32(w.rows as i32),
                        out.map_or(Arg::Ptr(0), |o| self.at(o, r0 * n)),
                    ]);
                }
                None => args.extend([
                    self.at(&mats[0].data, 0),
                    Arg::I32(mats[0].ty),
                    Arg::I32(0),
                    Arg::Ptr(0),
                ]),
            }
        }
        if int8 {
            match rope {
                Some(r) => args.extend([
                    Arg::I32(r.table),
                    Arg::I32(r.head_dim as i32),
                    self.at(r.k_cache, 0),
                    self.at(r.v_cache, 0),
                    self.at(&r.step.dev, 0),
                    Arg::I32(r.step.cap as i32),
                    Arg::I32(r0 as i32),
                ]),
                None => args.extend([
                    Arg::I32(0),
                    Arg::I32(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::I32(0),
                    Arg::I32(0),
                ]),
            }
            args.push(Arg::I32(i32::from(self.eight_lanes)));
        } else {
            assert!(rope.is_none(), "RoPE fuses only into the integer kernel");
        }
        // SAFETY: the arguments follow the kernel's signature (null pointers for an absent norm, unused outputs
        // and an absent RoPE fusion, which the kernel never touches); x holds rows × k values from r0, the norm
        // weight k, each output rows × its columns from r0, a fused RoPE's caches room for the step's slots; the
        // grid covers every column (tile) and row group once, and the staged rows fit the dynamic shared memory
        // asked for.
        unsafe { self.go("matmul", f, cfg, &args) };
    }

    #[allow(clippy::too_many_arguments)]
    fn matmuls_chunked(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        rows: usize,
        accumulate: bool,
        glu: bool,
        mats: &[&CudaMatrix],
        outs: &mut [&mut CudaSlice<f32>],
        rope: Option<&RopeFusion>,
    ) {
        let mut per_launch = mats.iter().map(|m| m.launch_rows).min().unwrap_or(1);
        if !Self::int8_launch(glu, mats) {
            // Tiled matrices beside untiled ones run the float kernel, whose staging caps the rows of long ones.
            per_launch = per_launch.min(self.float_rows(mats[0].cols));
        }
        let mut r0 = 0;
        while r0 < rows {
            let take = (rows - r0).min(per_launch);
            self.launch_matmuls(x, norm, r0, take, accumulate, glu, mats, outs, rope);
            r0 += take;
        }
    }

    /// Weight shapes checked so far, and how many of them failed the admission check (their verifies run one
    /// row per launch).
    pub fn admission(&self) -> (usize, usize) {
        let a = lock(&self.admitted);
        (a.len(), a.values().filter(|&&r| r < MAX_ROWS).count())
    }

    /// The admission check of the W-row projection kernel for `m`'s shape, on `m`'s own weights: widths 16 (two
    /// row groups), 5, 3 and 2 (each row-count variant; those above `m.launch_rows`, which the shared memory
    /// allows, are skipped) against the one-row kernel on pseudo-random rows, bitwise. Returns the rows one
    /// launch may take: `m.launch_rows` if admitted, else 1.
    fn admit(&self, m: &CudaMatrix) -> usize {
        let key = (m.ty, m.rows, m.cols);
        if let Some(&rows) = lock(&self.admitted).get(&key) {
            return rows;
        }
        if self.knockout {
            return m.launch_rows;
        }
        let (k, n) = (m.cols, m.rows);
        let mut seed = 0x9e37_79b9u32;
        let x: Vec<f32> = (0..MAX_ROWS * k)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect();
        let x = self.upload(&x);
        let mut one = self.buffer(MAX_ROWS * n);
        for r in 0..MAX_ROWS {
            self.launch_matmuls(&x, None, r, 1, false, false, &[m], &mut [&mut one], None);
        }
        let one = self.download(&one, MAX_ROWS * n);
        let mut wide = self.buffer(MAX_ROWS * n);
        let mut exact = true;
        for (r0, w) in [(0, MAX_ROWS), (1, 5), (6, 3), (9, 2)] {
            if w > m.launch_rows {
                continue;
            }
            self.launch_matmuls(&x, None, r0, w, false, false, &[m], &mut [&mut wide], None);
            let got = self.download(&wide, MAX_ROWS * n);
            let span = r0 * n..(r0 + w) * n;
            exact &= got[span.clone()]
                .iter()
                .zip(&one[span])
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        let rows = if exact {
            m.launch_rows
        } else {
            tracing::warn!(
                "the {MAX_ROWS}-row projection kernel is not bitwise the one-row kernel for a {n}×{k} matrix of \
                 type {}: its verifies run one row per launch",
                m.ty
            );
            1
        };
        lock(&self.admitted).insert(key, rows);
        rows
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
        // The bytes the kernels read: GGML blocks as stored (repacked into tensor-core tiles where the int8
        // kernels run them), MLX affine re-laid into 32-value blocks.
        let (tag, form, bytes) = match m.format {
            WeightFormat::Mlx(q) => {
                let blocks = affine::to_blocks(&m).expect("an MLX affine matrix");
                (
                    if q.bits == 4 {
                        Tag::Affine4
                    } else {
                        Tag::Affine8
                    },
                    None,
                    Cow::Owned(blocks),
                )
            }
            WeightFormat::Ggml(ty) => {
                let block = ty.block_len().max(32);
                if !m.cols.is_multiple_of(block) {
                    return Err(Error::Unsupported(format!(
                        "{}: rows of {} values (the CUDA kernels need a multiple of {block})",
                        m.name, m.cols
                    )));
                }
                match tiles::Form::of(ty).filter(|_| self.int8_tiles) {
                    Some(form) => (
                        Tag::Tiled(form),
                        Some(form),
                        Cow::Owned(tiles::tile(ty, m.rows, m.cols, m.data())),
                    ),
                    None => (Tag::Ggml(ty), None, Cow::Borrowed(m.data())),
                }
            }
        };
        let data = self
            .stream
            .clone_htod(bytes.as_ref())
            .map_err(|e| Error::Invalid(format!("CUDA upload of {}: {e}", m.name)))?;
        let mut matrix = CudaMatrix {
            ty: tag.value(),
            form,
            rows: m.rows,
            cols: m.cols,
            data,
            launch_rows: 0,
        };
        // The integer kernels stage long rows in windows, so only a shared memory without room for one
        // exchange chunk caps their rows; the float kernel stages whole rows.
        let fits = |r: usize| match form {
            Some(_) => [false, true].iter().all(|&glu| {
                self.q_geometry(r, m.cols, false, glu, &[&matrix, &matrix])
                    .is_some()
            }),
            None => staged_bytes(r, m.cols) <= self.matmul_shared,
        };
        matrix.launch_rows = (1..=MAX_ROWS).rev().find(|&r| fits(r)).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: rows of {} values do not fit the CUDA projection kernel's shared memory",
                m.name, m.cols
            ))
        })?;
        matrix.launch_rows = self.admit(&matrix);
        Ok(matrix)
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
        dev(
            "upload",
            self.stream
                .memcpy_htod(data, &mut buf.slice_mut(..data.len())),
        );
    }

    fn download(&self, buf: &CudaSlice<f32>, len: usize) -> Vec<f32> {
        dev("download", self.stream.clone_dtoh(&buf.slice(..len)))
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
        let bytes = at + max_rows * max_rows;
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
                for (i, v) in table.at(p).iter().enumerate() {
                    put(4 * (at + r * key.1 + i), v.to_le_bytes());
                }
            }
            used = 4 * (at + rows * key.1);
        }
        if let Some(v) = tree {
            for (i, &seen) in v.iter().enumerate() {
                h[step.mask_at + i] = u8::from(seen);
            }
            used = step.mask_at + v.len();
        }
        dev(
            "step upload",
            self.stream
                .memcpy_htod(&step.host[..used], &mut step.dev.slice_mut(..used)),
        );
    }

    fn replay_or_record(&self, key: u64, work: &mut dyn FnMut()) {
        let Some(store) = &self.graphs else {
            return work();
        };
        let mut g = lock(&store.0);
        if let Some(graph) = g.replay(key) {
            dev("graph launch", graph.launch());
            return;
        }
        dev(
            "graph capture",
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        );
        work();
        let graph = dev(
            "graph capture",
            self.stream.end_capture(CUgraphInstantiate_flags(0)),
        )
        .expect("a captured forward has operations");
        dev("graph launch", g.insert(key, graph).launch());
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
        self.matmuls_chunked(x, None, rows, false, false, &[w], &mut [out], None);
    }

    fn matmul_add(
        &self,
        w: &CudaMatrix,
        x: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.matmuls_chunked(x, None, rows, true, false, &[w], &mut [out], None);
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
            self.matmuls_chunked(x, norm, rows, false, false, &mats, &mut bufs, None);
        }
    }

    fn swiglu_matmul(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        rows: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        out: &mut CudaSlice<f32>,
    ) {
        assert_eq!(gate.rows, up.rows, "gate and up projections of one width");
        self.matmuls_chunked(x, norm, rows, false, true, &[gate, up], &mut [out], None);
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
        // neighbouring threads.
        let n_tiles: usize = mats.iter().map(|m| tiles::tiles(m.rows)).sum();
        let fused = self.fuse_rope
            && mats.iter().all(|m| m.form.is_some())
            && n_tiles < QM_WIDE_TILES
            && rope.style == RopeStyle::Interleaved
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
            self.rope_and_cache(q, k, v, k_cache, v_cache, shape, rope, step);
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
            false,
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
        let d = dim as i32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (dim / 32 * 4) as u32,
        };
        let args = [
            self.at(x, 0),
            self.at(w, 0),
            Arg::I32(d),
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
        step: &CudaStep,
    ) {
        let (rows, hd) = (shape.rows, shape.head_dim);
        let total =
            rows * (shape.n_heads + shape.n_kv_heads) * (hd / 2) + rows * shape.n_kv_heads * hd;
        let (r, nh, nkv, hdi, il, cap) = (
            rows as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            hd as i32,
            i32::from(rope.style == RopeStyle::Interleaved),
            step.cap as i32,
        );
        let args = [
            self.at(q, 0),
            self.at(k, 0),
            self.at(v, 0),
            self.at(k_cache, 0),
            self.at(v_cache, 0),
            Arg::I32(r),
            Arg::I32(nh),
            Arg::I32(nkv),
            Arg::I32(hdi),
            Arg::I32(step.rope_table(rope, hd)),
            Arg::I32(il),
            self.at(&step.dev, 0),
            Arg::I32(cap),
        ];
        // SAFETY: q holds rows × n_heads × head_dim values, k and v rows × kv_dim, the caches room for the
        // step's slots (reserved by the model); one thread per rotated pair and per copied V value.
        unsafe {
            self.go(
                "rope_and_cache",
                &self.k.rope_and_cache,
                grid(total, 256),
                &args,
            )
        };
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
            tables.push(RopeTable::new(key));
        }
        Ok(())
    }

    fn attention_work_len(&self, n_heads: usize, head_dim: usize, capacity: usize) -> usize {
        let per_row_head = 1 + capacity.div_ceil(ATT_CHUNK) * (head_dim + 2);
        MAX_ROWS * n_heads * per_row_head
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
        // Chunk records for every chunk of the cache's capacity (fixed while its buffers live, so a recorded
        // launch stays valid).
        let capacity = k_cache.len() / (shape.n_kv_heads * shape.head_dim);
        let chunks = capacity.div_ceil(ATT_CHUNK);
        assert!(work.len() >= self.attention_work_len(shape.n_heads, shape.head_dim, capacity));
        let (nh, nkv, hd, cap, nc) = (
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            step.cap as i32,
            chunks as i32,
        );
        let mut r0 = 0;
        while r0 < shape.rows {
            let take = (shape.rows - r0).min(MAX_ROWS);
            let heads = att_heads(
                shape.n_heads,
                shape.n_kv_heads,
                take,
                chunks,
                self.sms,
                self.att_heads,
            );
            let per_chunk = take * shape.n_heads / heads;
            let split = self.att_split(per_chunk, capacity);
            let cfg = LaunchConfig {
                grid_dim: (split as u32, per_chunk as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (heads * 4 * shape.head_dim * 4) as u32,
            };
            let row0 = r0 as i32;
            let args = [
                self.at(q, 0),
                self.at(k_cache, 0),
                self.at(v_cache, 0),
                Arg::I32(row0),
                Arg::I32(nh),
                Arg::I32(nkv),
                Arg::I32(hd),
                Arg::F32(shape.scale),
                self.at(&step.dev, 0),
                Arg::I32(cap),
                self.at(work, 0),
                Arg::I32(nc),
                self.at(out, 0),
            ];
            // The early-load variant takes more registers, so fewer of its blocks fit an SM: it runs where the
            // grid is small enough (decode steps, verifies of short contexts). Both give the same bits.
            let blocks = split * per_chunk;
            let f = if self.att_ahead && blocks <= self.att_ahead_per_sm * self.sms {
                &self.k.attention_ahead[heads - 1]
            } else {
                &self.k.attention[heads - 1]
            };
            // SAFETY: q/out hold rows × n_heads × head_dim values, the caches (base + rows) × kv_dim within
            // their capacity; `work` holds the counters and chunk records of up to MAX_ROWS rows (checked above);
            // the mask is in the step; both kernels take these arguments.
            unsafe { self.go("attention", f, cfg, &args) };
            r0 += take;
        }
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
        let s = src.slice(src_off..src_off + len);
        let mut d = dst.slice_mut(dst_off..dst_off + len);
        dev("copy", self.stream.memcpy_dtod(&s, &mut d));
    }

    fn copy_down(&self, buf: &mut CudaSlice<f32>, src_off: usize, dst_off: usize, len: usize) {
        assert!(dst_off + len <= src_off, "copy_down ranges overlap");
        if len == 0 {
            return;
        }
        let (mut lo, hi) = buf.split_at_mut(src_off);
        let s = hi.slice(0..len);
        let mut d = lo.slice_mut(dst_off..dst_off + len);
        dev("copy", self.stream.memcpy_dtod(&s, &mut d));
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::{att_heads, nvrtc_options, row_groups, source, CudaBackend, CudaOptions};

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

    #[test]
    fn o_and_down_take_two_row_groups_at_seven_and_eight_rows_but_qkv_keeps_one() {
        // SmolLM2 on an H200 (132 SMs, 24-warp many-row CTAs): o 576 -> 576 (36 tiles), down 1536 -> 576 (36),
        // Q/K/V 576 -> 960 (60, RoPE fused), gate/up 576 -> 1536 (96).
        let groups = |tiles, rows, k, rope| row_groups(tiles, rows, k, rope, 132, 768, true);
        assert_eq!(groups(36, 8, 576, false), 2);
        assert_eq!(groups(36, 8, 1536, false), 2);
        assert_eq!(groups(36, 7, 1536, false), 2);
        assert_eq!(groups(60, 8, 576, true), 1);
        assert_eq!(groups(96, 8, 576, false), 1); // 192 CTAs would not fit the SMs together
        assert_eq!(row_groups(36, 8, 576, false, 132, 768, false), 1);
    }

    #[test]
    fn groups_of_fewer_than_four_rows_are_never_made_up_to_eight_rows() {
        let groups = |rows| row_groups(36, rows, 1536, false, 132, 768, true);
        for rows in 1..=6 {
            assert_eq!(groups(rows), 1, "{rows} rows");
        }
        // Halves whose staging would not fit one pass of the CTA's threads stay whole.
        assert_eq!(row_groups(36, 8, 4096, false, 132, 768, true), 1);
    }

    #[test]
    fn past_eight_rows_the_groups_fill_the_sms_and_none_is_empty() {
        assert_eq!(row_groups(36, 16, 576, false, 132, 768, true), 3); // 132 / 36 = 3 groups of 6, 6, 4
        assert_eq!(row_groups(60, 16, 576, true, 132, 768, true), 2);
        assert_eq!(row_groups(96, 16, 576, false, 132, 768, true), 1);
        assert_eq!(row_groups(4, 10, 576, false, 132, 768, true), 10); // 33 wanted, one row each
    }

    #[test]
    fn attention_blocks_serve_a_head_each_while_they_fit_two_per_sm() {
        let sms = 132;
        assert_eq!(att_heads(9, 3, 1, 8, sms, None), 1); // SmolLM2, W=1 over a cache of 512
        assert_eq!(att_heads(9, 3, 2, 8, sms, None), 1);
        assert_eq!(att_heads(9, 3, 4, 8, sms, None), 3);
        assert_eq!(att_heads(9, 3, 8, 5, sms, None), 3);
        assert_eq!(att_heads(9, 3, 16, 1, sms, None), 1);
        assert_eq!(att_heads(9, 3, 1, 32, sms, None), 3);
        assert_eq!(att_heads(9, 3, 2, 16, sms, None), 3);
    }

    #[test]
    fn a_group_block_serves_the_largest_divisor_of_the_group_up_to_four_heads() {
        let many = |n_heads, n_kv_heads| att_heads(n_heads, n_kv_heads, 16, 32, 132, None);
        assert_eq!(many(9, 3), 3);
        assert_eq!(many(4, 1), 4); // Gemma 3 270M
        assert_eq!(many(32, 4), 4);
        assert_eq!(many(28, 4), 1); // groups of 7
        assert_eq!(many(24, 4), 3); // groups of 6
        assert_eq!(many(8, 8), 1); // no GQA
        assert_eq!(att_heads(9, 3, 1, 8, 132, Some(3)), 3);
        assert_eq!(att_heads(16, 2, 16, 32, 132, Some(2)), 2);
    }

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
