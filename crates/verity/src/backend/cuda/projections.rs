//! Projection launches: which kernel and schedule a launch takes, its row groups and shared-memory geometry
//! (`geometry.rs`), a matrix's upload in the layout its kernel reads, and the admission check of its W-row
//! launches.

use std::borrow::Cow;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::geometry::{
    q_geometry, staged_bytes, QGeometry, GEMM_SHARED_BYTES, GEMM_WARPS, ROWS_PER_GROUP,
};
use super::launch::Arg;
use super::types::Tag;
use super::{
    affine, dev, lock, tiles, CudaBackend, CudaMatrix, CudaStep, StagedFor, StagedX, STAGED_ROWS,
};
use super::{GROUP_ROWS_MIN, MAX_ROWS, MM_WARPS, TALL_CTA_ROWS, TALL_ROWS, WIDE_COLUMNS};
use crate::backend::{Backend, Glu};
use crate::error::{Error, Result};
use crate::quant::{QMatrix, WeightFormat};

/// A weight shape's admission verdict (`CudaBackend::admit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Admitted {
    /// Rows one narrow or wide launch may take: the shared memory's limit, or 1 where the W-row launches are
    /// not bitwise the one-row kernel.
    pub(super) rows: usize,
    /// Whether launches of more than `MAX_ROWS` rows take the tall schedule.
    pub(super) tall: bool,
    /// Whether they may take the GEMM schedule.
    pub(super) gemm: bool,
}

/// RoPE and the cache write fused into a Q/K/V launch of the integer kernel (`kernels.cu`'s `RopeFusion`).
pub(super) struct RopeFusion<'a> {
    /// The step's `(cos, sin)` table (`CudaStep::rope_table`).
    pub(super) table: i32,
    pub(super) head_dim: usize,
    pub(super) k_cache: &'a CudaSlice<f32>,
    pub(super) v_cache: &'a CudaSlice<f32>,
    pub(super) step: &'a CudaStep,
}

/// Row groups of a narrow projection launch of `tiles` CTAs and `rows` rows (`sms` on the device), each group's
/// rows a launch of their own (`kernels.cu`'s `qmatmuls_body`). Past 8 rows, where one CTA would pad its rows
/// to 16 (two MMA n-tiles, twice the MMAs per block), as many groups as leave no CTA waiting for an SM, which is
/// faster at 16 rows. At 8 rows or fewer (unless `split_rows` is false), two groups where both CTAs of a tile fit
/// the SMs together, each group has at least `GROUP_ROWS_MIN` rows (fewer rows per CTA), and the launch is not a
/// Q/K/V projection with RoPE fused (attention's blocks start while it runs, loading their first chunk, on the
/// SMs it leaves free). Splitting o and down at 7-8 rows makes 8-row verifies faster and one-row steps no
/// slower; splitting the Q/K/V launch too, or groups of three rows (at 5-6 rows, in the few-row kernel), is
/// slower (measured with the previous narrow schedule: BENCHMARKS.md, "Verify cost by width"). No bits depend on it: a (column, row)'s arithmetic
/// is the same in any group (`rowexact`, the admission).
fn row_groups(tiles: usize, rows: usize, rope: bool, sms: usize, split_rows: bool) -> usize {
    let half = rows.div_ceil(2);
    let split = split_rows && half >= GROUP_ROWS_MIN && 2 * tiles <= sms && !rope;
    let want = if rows > 8 {
        sms / tiles.max(1)
    } else if split {
        2
    } else {
        1
    };
    nonempty_groups(rows, want)
}

/// Row groups of a tall launch of `tiles` CTAs and `rows` rows: as few as leave a CTA at most `TALL_CTA_ROWS`
/// rows, unless the tiles leave SMs idle; then as many as fill them, but no more than launches of `MAX_ROWS`
/// rows would take (each group reads the weights again, from L2 where the groups run together).
fn tall_groups(tiles: usize, rows: usize, sms: usize) -> usize {
    let fill = (sms / tiles.max(1)).clamp(1, rows.div_ceil(MAX_ROWS));
    nonempty_groups(rows, fill.max(rows.div_ceil(TALL_CTA_ROWS)))
}

/// The grid of a GEMM-schedule launch of `tiles` tiles (gate/up: pairs) and `rows` rows: CTAs of `GEMM_WARPS`
/// tiles (half as many pairs), and row groups as a tall launch's.
fn gemm_grid(tiles: usize, glu: bool, rows: usize, sms: usize) -> (usize, usize) {
    let ctas = tiles.div_ceil(if glu { GEMM_WARPS / 2 } else { GEMM_WARPS });
    (ctas, tall_groups(ctas, rows, sms))
}

/// The groups a launch of `rows` rows in `want` groups has: the kernel gives each group ceil(rows / groups) rows,
/// so as many as that leaves non-empty.
fn nonempty_groups(rows: usize, want: usize) -> usize {
    let per = rows.div_ceil(want.clamp(1, rows.max(1)));
    rows.div_ceil(per)
}

impl CudaBackend {
    /// `m` on the device in the layout its kernels read, its W-row launches admitted (`Backend::load_matrix`).
    pub(super) fn upload_matrix(&self, m: QMatrix) -> Result<CudaMatrix> {
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
            tall: false,
            gemm: false,
        };
        // The integer kernels read x quantized (any row length runs); the float kernel stages whole rows.
        if form.is_some() {
            self.reserve_staged(m.cols);
        }
        let fits = |r: usize| match form {
            Some(_) => self.q_geometry(r, m.cols, false, true).is_some(),
            None => staged_bytes(r, m.cols) <= self.matmul_shared,
        };
        matrix.launch_rows = (1..=MAX_ROWS).rev().find(|&r| fits(r)).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: rows of {} values do not fit the CUDA projection kernel's shared memory",
                m.name, m.cols
            ))
        })?;
        let admitted = self.admit(&matrix);
        (matrix.launch_rows, matrix.tall, matrix.gemm) =
            (admitted.rows, admitted.tall, admitted.gemm);
        Ok(matrix)
    }

    /// Row groups of a narrow projection launch (see [`row_groups`]), or the count `VERITY_CUDA_ROW_GROUPS`
    /// forces.
    fn row_groups(&self, tiles: usize, rows: usize, rope: bool) -> usize {
        match self.row_groups {
            Some(forced) => nonempty_groups(rows, forced),
            None => row_groups(tiles, rows, rope, self.sms, self.split_rows),
        }
    }

    /// Room in the quantized-input buffer for rows of `k` values (see [`StagedX`]).
    fn reserve_staged(&self, k: usize) {
        let mut staged = lock(&self.staged);
        if staged.last().is_some_and(|s| s.k >= k) {
            return;
        }
        staged.push(StagedX {
            k,
            xq: dev("alloc", self.stream.alloc_zeros::<u8>(STAGED_ROWS * k)),
            xd: self.buffer(STAGED_ROWS * k / 32),
            xs: self.buffer(STAGED_ROWS * k / 32),
        });
    }

    /// Threads of a `quantize_x` launch (or a fused staging) over rows of `k` values: four per 32-value block in
    /// one pass where the CTA's 1,024 threads allow, else two.
    fn staging_threads(k: usize) -> usize {
        (k / 32 * 4).clamp(32, 1024).next_multiple_of(32)
    }

    /// Whether a launch over `rows` rows of `k` values may also stage them for the projection that follows: rows
    /// of a verify's size or fewer, whole 32-value blocks, and a quantized-input buffer that holds them.
    pub(super) fn can_stage(&self, rows: usize, k: usize) -> bool {
        rows <= MAX_ROWS
            && k.is_multiple_of(32)
            && lock(&self.staged).last().is_some_and(|s| s.k >= k)
    }

    /// What rows `0..rows` of `x`, through `norm`, staged in the current quantized-input buffer are known as.
    pub(super) fn staged_key(
        &self,
        x: &CudaSlice<f32>,
        r0: usize,
        rows: usize,
        k: usize,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> StagedFor {
        let ptr = |a: Arg| match a {
            Arg::Ptr(p) => p,
            _ => unreachable!("an address"),
        };
        StagedFor {
            x: ptr(self.at(x, r0 * k)),
            rows,
            k,
            norm: norm.map_or(0, |(w, _)| ptr(self.at(w, 0))),
            eps: norm.map_or(0, |(_, eps)| eps.to_bits()),
            buffer: lock(&self.staged).len(),
        }
    }

    /// `rows` rows of x from row `r0` (RMS-normed first with `norm`) quantized for an integer projection launch
    /// (`kernels.cu`'s `quantize_x`), unless the launch just before staged exactly these (`rms_norm_add` told of
    /// this projection, or the attention whose output it is); returns the addresses of the quantized rows, scales and sums.
    fn quantize_x(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        r0: usize,
        rows: usize,
        k: usize,
    ) -> [Arg<'static>; 3] {
        let ahead = lock(&self.staged_for).take();
        let found = ahead.is_some_and(|a| a == self.staged_key(x, r0, rows, k, norm));
        let staged = lock(&self.staged);
        let s = staged
            .last()
            .expect("reserved when a tiled matrix was loaded");
        debug_assert!(s.k >= k && rows <= STAGED_ROWS);
        let staged_args = [self.at(&s.xq, 0), self.at(&s.xd, 0), self.at(&s.xs, 0)];
        if found {
            return staged_args;
        }
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (Self::staging_threads(k) as u32, 1, 1),
            shared_mem_bytes: (k / 32 * 4) as u32,
        };
        let args = [
            self.at(x, r0 * k),
            Arg::I32(k as i32),
            norm.map_or(Arg::Ptr(0), |(w, _)| self.at(w, 0)),
            Arg::F32(norm.map_or(0.0, |n| n.1)),
            staged_args[0],
            staged_args[1],
            staged_args[2],
        ];
        // SAFETY: x holds rows × k values from r0, the norm weight k; the buffer has room for STAGED_ROWS ≥ rows
        // rows of k values; the shared memory holds the norm's k / 32 floats of scratch.
        unsafe { self.go("quantize", &self.k.quantize_x, cfg, &args) };
        staged_args
    }

    /// `x += rms_norm(t) · w` over `rows` rows of `k` values (`Backend::rms_norm_add`); with `next`, rows of a
    /// verify's size or fewer are also staged for the projection through that norm which comes next (the
    /// `quantize_x` launch it then skips, done in the same block shape, so the same bits).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_rms_norm_add(
        &self,
        t: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        k: usize,
        eps: f32,
        x: &mut CudaSlice<f32>,
        next: Option<(&CudaSlice<f32>, f32)>,
    ) {
        let next = next.filter(|_| self.can_stage(rows, k));
        let key = next.map(|n| self.staged_key(x, 0, rows, k, Some(n)));
        let staged = lock(&self.staged);
        let target = next.and_then(|n| staged.last().map(|s| (n, s)));
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (Self::staging_threads(k) as u32, 1, 1),
            shared_mem_bytes: (k / 32 * 4) as u32,
        };
        let args = [
            self.at(t, 0),
            self.at(w, 0),
            Arg::F32(eps),
            self.at(x, 0),
            Arg::I32(k as i32),
            target.map_or(Arg::Ptr(0), |((nw, _), _)| self.at(nw, 0)),
            Arg::F32(target.map_or(0.0, |((_, e), _)| e)),
            target.map_or(Arg::Ptr(0), |(_, s)| self.at(&s.xq, 0)),
            target.map_or(Arg::Ptr(0), |(_, s)| self.at(&s.xd, 0)),
            target.map_or(Arg::Ptr(0), |(_, s)| self.at(&s.xs, 0)),
        ];
        // SAFETY: t and x hold rows × k values, w and the next norm k; a staging target has room for rows ≤
        // MAX_ROWS < STAGED_ROWS rows of k values; the shared memory holds k / 32 floats of norm scratch.
        unsafe { self.go("rms_norm_add", &self.k.rms_norm_add, cfg, &args) };
        drop(staged);
        *lock(&self.staged_for) = key;
    }

    /// Whether a launch of `mats` runs the integer kernels: every matrix tiled, and gate and up of one type.
    fn int8_launch(glu: bool, mats: &[&CudaMatrix]) -> bool {
        mats.iter().all(|m| m.form.is_some()) && (!glu || mats[0].ty == mats[1].ty)
    }

    /// Whether `rows` rows of `mats` take the tall schedule: more than one narrow launch's rows, the integer
    /// kernels, every matrix admitted for it.
    fn tall_launch(&self, rows: usize, glu: bool, mats: &[&CudaMatrix]) -> bool {
        self.tall && rows > MAX_ROWS && Self::int8_launch(glu, mats) && mats.iter().all(|m| m.tall)
    }

    /// The tiles of a launch of `mats` (gate/up: the pairs).
    fn launch_tiles(glu: bool, mats: &[&CudaMatrix]) -> usize {
        if glu {
            tiles::tiles(mats[0].rows)
        } else {
            mats.iter().map(|m| tiles::tiles(m.rows)).sum()
        }
    }

    /// Whether a tall launch of `rows` rows of `mats` takes the GEMM schedule: every matrix admitted for it, and
    /// its grid at least `gemm_ctas` CTAs (by default one per SM: below that the tall schedule's CTA per tile
    /// keeps more SMs busy).
    fn gemm_launch(&self, rows: usize, glu: bool, mats: &[&CudaMatrix]) -> bool {
        self.gemm && mats.iter().all(|m| m.gemm) && {
            let (ctas, groups) = gemm_grid(Self::launch_tiles(glu, mats), glu, rows, self.sms);
            ctas * groups >= self.gemm_ctas.unwrap_or(self.sms)
        }
    }

    /// Whether the GEMM schedule may run rows of `k` values: the tall one may, and its stages fit the shared
    /// memory.
    fn gemm_fits(&self, k: usize) -> bool {
        self.gemm && self.tall_fits(k) && GEMM_SHARED_BYTES <= self.matmul_shared
    }

    /// Whether the tall schedule may run rows of `k` values: on, and its run sums of gate and up fit the shared
    /// memory.
    fn tall_fits(&self, k: usize) -> bool {
        self.tall && self.int8_tiles && self.q_geometry(TALL_CTA_ROWS, k, false, true).is_some()
    }

    /// The most rows the float kernel stages for rows of `k` values (at least 1: a row that does not fit was
    /// refused at load).
    fn float_rows(&self, k: usize) -> usize {
        (1..=MAX_ROWS)
            .rev()
            .find(|&r| staged_bytes(r, k) <= self.matmul_shared)
            .unwrap_or(1)
    }

    /// The geometry of an integer launch of `rows` rows (per CTA) of `k` values, gate/up when `glu`.
    fn q_geometry(&self, rows: usize, k: usize, wide: bool, glu: bool) -> Option<QGeometry> {
        let stream = if wide { 0 } else { self.narrow_stream_bytes };
        q_geometry(
            rows,
            k,
            wide,
            if glu { 2 } else { 1 },
            stream,
            self.matmul_shared,
        )
    }

    /// One launch of the `matmuls` kernel over up to three matrices that share `x` (`rows` ≤ `TALL_ROWS`, row
    /// offset `r0` into `x` and every output): `outs[m]` receives `mats[m]`'s projection; with an activation
    /// `act`, `mats` are the gate and up projections and their gated product goes to the one output. Launches
    /// of more than `MAX_ROWS` rows take the tall schedule, or with `gemm` the GEMM schedule.
    #[allow(clippy::too_many_arguments)]
    fn launch_matmuls(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        r0: usize,
        rows: usize,
        accumulate: bool,
        act: Option<Glu>,
        mats: &[&CudaMatrix],
        outs: &mut [&mut CudaSlice<f32>],
        rope: Option<&RopeFusion>,
        gemm: bool,
    ) {
        let glu = act.is_some();
        let tall = rows > MAX_ROWS;
        let gemm = tall && gemm;
        debug_assert!((1..=3).contains(&mats.len()) && rows <= TALL_ROWS);
        // Tall launches: what `matmuls_chunked` (or the admission check) asks for.
        debug_assert!(if tall {
            Self::int8_launch(glu, mats)
        } else {
            mats.iter().all(|m| rows <= m.launch_rows)
        });
        debug_assert_eq!(outs.len(), if glu { 1 } else { mats.len() });
        let k = mats[0].cols;
        assert!(
            mats.iter().all(|w| w.cols == k),
            "projections of one input must share its width"
        );
        // The kernels' `glu`: 0 none, 1 SwiGLU, 2 GeGLU (tanh form).
        let glu_i = match act {
            None => 0,
            Some(Glu::Silu) => 1,
            Some(Glu::GeluTanh) => 2,
        };
        let acc = i32::from(accumulate);
        let int8 = Self::int8_launch(glu, mats);
        let mut args = if int8 {
            let [xq, xd, xs] = self.quantize_x(x, norm, r0, rows, k);
            vec![xq, xd, xs, Arg::I32(k as i32)]
        } else {
            vec![self.at(x, r0 * k), Arg::I32(k as i32)]
        };
        args.extend([Arg::I32(rows as i32), Arg::I32(acc)]);
        if !int8 {
            args.extend([
                norm.map_or(Arg::Ptr(0), |(w, _)| self.at(w, 0)),
                Arg::F32(norm.map_or(0.0, |n| n.1)),
            ]);
        }
        args.push(Arg::I32(glu_i));
        let (f, cfg) = if int8 {
            let n_tiles = Self::launch_tiles(glu, mats);
            // The wide schedule's CTAs may straddle matrices, so it needs them of one type (`kernels.cu`).
            let wide =
                !tall && n_tiles >= self.wide_tiles && mats.iter().all(|m| m.ty == mats[0].ty);
            let (ctas, groups) = if gemm {
                gemm_grid(n_tiles, glu, rows, self.sms)
            } else if tall {
                (n_tiles, tall_groups(n_tiles, rows, self.sms))
            } else if wide {
                (n_tiles.div_ceil(self.wide_warps), 1)
            } else {
                (n_tiles, self.row_groups(n_tiles, rows, rope.is_some()))
            };
            // The rows one CTA takes (the kernel's own split).
            let cta_rows = rows.div_ceil(groups);
            let bytes = if gemm {
                GEMM_SHARED_BYTES
            } else {
                self.q_geometry(cta_rows, k, wide, glu)
                    .expect("capped by `launch_rows` and `tall_fits`")
                    .bytes
            };
            // The schedules give every (column, row) the same arithmetic: which one a launch takes changes no
            // bits.
            let (f, warps) = if gemm {
                (&self.k.qmatmuls_gemm, GEMM_WARPS)
            } else if tall {
                (&self.k.qmatmuls_tall, self.narrow_warps)
            } else if wide {
                (&self.k.qmatmuls_wide, self.wide_warps)
            } else if self.narrow8 && cta_rows <= 8 {
                (&self.k.qmatmuls_narrow8, self.narrow_warps)
            } else {
                (&self.k.qmatmuls_narrow, self.narrow_warps)
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
        } else {
            assert!(rope.is_none(), "RoPE fuses only into the integer kernel");
        }
        // SAFETY: the arguments follow the kernel's signature (null pointers for an absent norm, unused outputs
        // and an absent RoPE fusion, which the kernel never touches); x (or its quantized rows) holds rows × k
        // values from r0, the norm weight k, each output rows × its columns from r0, a fused RoPE's caches room
        // for the step's slots; the grid covers every column (tile) and row group once, and what a CTA keeps in
        // shared memory fits the dynamic shared memory asked for.
        unsafe { self.go("matmul", f, cfg, &args) };
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmuls_chunked(
        &self,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        rows: usize,
        accumulate: bool,
        act: Option<Glu>,
        mats: &[&CudaMatrix],
        outs: &mut [&mut CudaSlice<f32>],
        rope: Option<&RopeFusion>,
    ) {
        let glu = act.is_some();
        let tall = self.tall_launch(rows, glu, mats);
        let mut per_launch = mats.iter().map(|m| m.launch_rows).min().unwrap_or(1);
        if !Self::int8_launch(act.is_some(), mats) {
            // Tiled matrices beside untiled ones run the float kernel, whose staging caps the rows of long ones.
            per_launch = per_launch.min(self.float_rows(mats[0].cols));
        }
        let mut r0 = 0;
        while r0 < rows {
            let left = rows - r0;
            // Tall launches of up to TALL_ROWS rows while more than MAX_ROWS are left.
            let take = if tall && left > MAX_ROWS {
                left.min(TALL_ROWS)
            } else {
                left.min(per_launch)
            };
            let gemm = take > MAX_ROWS && self.gemm_launch(take, glu, mats);
            self.launch_matmuls(x, norm, r0, take, accumulate, act, mats, outs, rope, gemm);
            r0 += take;
        }
    }
    /// Weight shapes checked so far, and how many of them failed the admission check (their verifies run one
    /// row per launch, or their prefill chunks in launches of `MAX_ROWS`).
    pub fn admission(&self) -> (usize, usize) {
        let a = lock(&self.admitted);
        let failed = a
            .iter()
            .filter(|((_, _, k), v)| {
                v.rows < MAX_ROWS
                    || (self.tall_fits(*k) && !v.tall)
                    || (self.gemm_fits(*k) && !v.gemm)
            })
            .count();
        (a.len(), failed)
    }

    /// The admission check of the multi-row projection kernels for `m`'s shape, on `m`'s own weights, bitwise
    /// against the one-row kernel on pseudo-random rows: widths 16 (two row groups), 5, 3 and 2 (each row-count
    /// variant; those above `m.launch_rows`, which the shared memory allows, are skipped), and for the tall
    /// and GEMM schedules 64 rows and 37 rows from row 5 (a partial last n-tile, rows past the launch's read).
    fn admit(&self, m: &CudaMatrix) -> Admitted {
        let key = (m.ty, m.rows, m.cols);
        if let Some(&verdict) = lock(&self.admitted).get(&key) {
            return verdict;
        }
        let tall_possible = m.form.is_some() && self.tall_fits(m.cols);
        let gemm_possible = m.form.is_some() && self.gemm_fits(m.cols);
        if self.knockout {
            return Admitted {
                rows: m.launch_rows,
                tall: tall_possible,
                gemm: gemm_possible,
            };
        }
        let (k, n) = (m.cols, m.rows);
        let mut seed = 0x9e37_79b9u32;
        let x: Vec<f32> = (0..TALL_ROWS * k)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect();
        let x = self.upload(&x);
        let mut one = self.buffer(TALL_ROWS * n);
        let checked = if tall_possible { TALL_ROWS } else { MAX_ROWS };
        for r in 0..checked {
            self.launch_matmuls(
                &x,
                None,
                r,
                1,
                false,
                None,
                &[m],
                &mut [&mut one],
                None,
                false,
            );
        }
        let one = self.download(&one, TALL_ROWS * n);
        let mut many = self.buffer(TALL_ROWS * n);
        // A launch of more than MAX_ROWS rows takes the tall schedule, or with `gemm` the GEMM one.
        let mut exact_at = |r0: usize, w: usize, gemm: bool| {
            self.launch_matmuls(
                &x,
                None,
                r0,
                w,
                false,
                None,
                &[m],
                &mut [&mut many],
                None,
                gemm,
            );
            let got = self.download(&many, TALL_ROWS * n);
            let span = r0 * n..(r0 + w) * n;
            got[span.clone()]
                .iter()
                .zip(&one[span])
                .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        let narrow = [(0, MAX_ROWS), (1, 5), (6, 3), (9, 2)]
            .into_iter()
            .filter(|&(_, w)| w <= m.launch_rows)
            .all(|(r0, w)| exact_at(r0, w, false));
        let tall_at = [(0, TALL_ROWS), (5, 37)];
        let tall = tall_possible && tall_at.into_iter().all(|(r0, w)| exact_at(r0, w, false));
        let gemm = gemm_possible && tall_at.into_iter().all(|(r0, w)| exact_at(r0, w, true));
        if !narrow {
            tracing::warn!(
                "the {MAX_ROWS}-row projection kernel is not bitwise the one-row kernel for a {n}×{k} matrix of \
                 type {}: its verifies run one row per launch",
                m.ty
            );
        }
        if tall_possible && !tall {
            tracing::warn!(
                "the tall projection kernel is not bitwise the one-row kernel for a {n}×{k} matrix of type {}: \
                 its prefill runs in launches of {MAX_ROWS} rows",
                m.ty
            );
        }
        if gemm_possible && !gemm {
            tracing::warn!(
                "the GEMM projection kernel is not bitwise the one-row kernel for a {n}×{k} matrix of type {}: \
                 its prefill takes the tall schedule",
                m.ty
            );
        }
        let verdict = Admitted {
            rows: if narrow { m.launch_rows } else { 1 },
            tall,
            gemm,
        };
        lock(&self.admitted).insert(key, verdict);
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::{gemm_grid, row_groups, tall_groups};

    #[test]
    fn tall_launches_split_their_rows_only_where_the_tiles_leave_sms_idle() {
        // A 1B model on an H100 (132 SMs): gate/up 512 tiles, q/o/down 128, k/v 32.
        assert_eq!(tall_groups(512, 64, 132), 1);
        assert_eq!(tall_groups(128, 64, 132), 1);
        assert_eq!(tall_groups(32, 64, 132), 4);
        // SmolLM2's o (36 tiles) at 20 rows: two groups, never more than 16-row launches would be.
        assert_eq!(tall_groups(36, 20, 132), 2);
        assert_eq!(tall_groups(3, 64, 132), 4);
        // Past 64 rows a CTA never takes more than 64 (8B gate/up pairs: 224 CTAs).
        assert_eq!(tall_groups(224, 256, 132), 4);
        assert_eq!(tall_groups(224, 65, 132), 2);
        assert_eq!(tall_groups(48, 256, 132), 4);
    }

    #[test]
    fn gemm_grids_hold_eight_tiles_or_four_gate_up_pairs_a_cta() {
        // An 8B model's 64-row prefill chunk on an H100: gate/up 896 pairs, Q/K/V 384 tiles, o 256.
        assert_eq!(gemm_grid(896, true, 64, 132), (224, 1));
        assert_eq!(gemm_grid(384, false, 64, 132), (48, 2));
        assert_eq!(gemm_grid(256, false, 64, 132), (32, 4));
        // A 1B model's gate/up: 512 pairs, 128 CTAs (under one per SM).
        assert_eq!(gemm_grid(512, true, 64, 132), (128, 1));
        assert_eq!(gemm_grid(3, false, 20, 132), (1, 2));
    }

    #[test]
    fn o_and_down_take_two_row_groups_at_seven_and_eight_rows_but_qkv_keeps_one() {
        // SmolLM2 on an H200 (132 SMs): o 576 -> 576 (36 tiles), down 1536 -> 576 (36),
        // Q/K/V 576 -> 960 (60, RoPE fused), gate/up 576 -> 1536 (96).
        let groups = |tiles, rows, rope| row_groups(tiles, rows, rope, 132, true);
        assert_eq!(groups(36, 8, false), 2);
        assert_eq!(groups(36, 7, false), 2);
        assert_eq!(groups(60, 8, true), 1);
        assert_eq!(groups(96, 8, false), 1); // 192 CTAs would not fit the SMs together
        assert_eq!(row_groups(36, 8, false, 132, false), 1);
    }
    #[test]
    fn groups_of_fewer_than_four_rows_are_never_made_up_to_eight_rows() {
        let groups = |rows| row_groups(36, rows, false, 132, true);
        for rows in 1..=6 {
            assert_eq!(groups(rows), 1, "{rows} rows");
        }
    }
    #[test]
    fn past_eight_rows_the_groups_fill_the_sms_and_none_is_empty() {
        assert_eq!(row_groups(36, 16, false, 132, true), 3); // 132 / 36 = 3 groups of 6, 6, 4
        assert_eq!(row_groups(60, 16, true, 132, true), 2);
        assert_eq!(row_groups(96, 16, false, 132, true), 1);
        assert_eq!(row_groups(4, 10, false, 132, true), 10); // 33 wanted, one row each
    }
}
