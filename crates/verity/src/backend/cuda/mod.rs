//! The CUDA backend (feature `cuda`): weights uploaded in their GGML block format, f32 activations, CUDA C
//! kernels (`kernels.cu`) compiled by NVRTC at load for the card's architecture, launched through cudarc with
//! the driver loaded at run time — so the build needs no CUDA toolkit, and a machine without a GPU gets a clear
//! error instead of a link failure.
//!
//! Row-exactness: the matmul gives each output column to one warp that decodes each weight block once and
//! applies it to every row of the launch (up to `MAX_ROWS`, larger batches in chunks), each row's sums in a
//! fixed order; attention, norms and RoPE are per row. So a W-row verify gives each row bitwise the one-row
//! step's result on this backend.
//!
//! This is the first, correctness-first version: one launch per operation, no CUDA graphs, no fused small ops,
//! no tensor-core or vectorized weight loads, GGML F32/F16/BF16/Q4_0/Q4_1/Q8_0 weights only (K-quants and MLX
//! affine are refused at load). The `Backend` operations cannot fail, so a device error after load panics
//! with the driver's message.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::backend::{AttnMask, AttnShape, Backend};
use crate::error::{Error, Result};
use crate::model::hparams::RopeStyle;
use crate::quant::{GgmlType, QMatrix, WeightFormat};

const SOURCE: &str = include_str!("kernels.cu");
/// Rows per matmul launch (the kernel's `MAX_ROWS`).
const MAX_ROWS: usize = 8;
/// Dynamic shared memory of one attention block (the default limit without opting in to more).
const ATTENTION_SHARED_BYTES: usize = 48 * 1024;

/// A weight matrix on the device, in its GGML block format.
pub struct CudaMatrix {
    ty: i32,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
}

struct Kernels {
    matmul: CudaFunction,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    swiglu: CudaFunction,
    add_assign: CudaFunction,
    add_bias: CudaFunction,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    name: String,
}

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
    /// Open GPU `ordinal` and compile the kernels for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| Error::Invalid(format!("CUDA {what}: {e}"));
        let ctx = CudaContext::new(ordinal).map_err(|e| err("device", &e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| err("device", &e))?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let ptx = compile_ptx_with_opts(
            SOURCE,
            CompileOptions {
                arch: Some(arch),
                ..Default::default()
            },
        )
        .map_err(|e| err("kernel compilation", &e))?;
        let module = ctx.load_module(ptx).map_err(|e| err("module", &e))?;
        let f = |n: &str| module.load_function(n).map_err(|e| err(n, &e));
        let k = Kernels {
            matmul: f("matmul")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            attention: f("attention")?,
            swiglu: f("swiglu")?,
            add_assign: f("add_assign")?,
            add_bias: f("add_bias")?,
        };
        let name = format!(
            "cuda:{ordinal} ({}, sm_{major}{minor})",
            ctx.name().unwrap_or_default()
        );
        let stream = ctx.default_stream();
        Ok(CudaBackend {
            ctx,
            stream,
            k,
            name,
        })
    }
}

fn type_tag(name: &str, ty: GgmlType) -> Result<i32> {
    Ok(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q4_0 => 3,
        GgmlType::Q4_1 => 4,
        GgmlType::Q8_0 => 5,
        other => {
            return Err(Error::Unsupported(format!(
                "{name}: {} weights on the CUDA backend (it runs F32, F16, BF16, Q4_0, Q4_1, Q8_0)",
                other.name()
            )))
        }
    })
}

impl Backend for CudaBackend {
    type Buffer = CudaSlice<f32>;
    type Matrix = CudaMatrix;

    fn name(&self) -> String {
        self.name.clone()
    }

    /// The attention kernel keeps a row's scores in 48 KB of shared memory.
    fn max_attention_slots(&self) -> usize {
        ATTENTION_SHARED_BYTES / 4
    }

    fn load_matrix(&self, m: QMatrix) -> Result<CudaMatrix> {
        let WeightFormat::Ggml(ty) = m.format else {
            return Err(Error::Unsupported(format!(
                "{}: {} weights on the CUDA backend",
                m.name, m.format
            )));
        };
        let tag = type_tag(&m.name, ty)?;
        if !m.cols.is_multiple_of(32) {
            return Err(Error::Unsupported(format!(
                "{}: rows of {} values (the CUDA kernels need a multiple of 32)",
                m.name, m.cols
            )));
        }
        let data = self
            .stream
            .clone_htod(m.data())
            .map_err(|e| Error::Invalid(format!("CUDA upload of {}: {e}", m.name)))?;
        Ok(CudaMatrix {
            ty: tag,
            rows: m.rows,
            cols: m.cols,
            data,
        })
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

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaSlice<f32>) {
        let t = dev("upload", self.stream.clone_htod(tokens));
        let (ty, k) = (table.ty, table.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (tokens.len() as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.k.embed);
        b.arg(&table.data).arg(&ty).arg(&k).arg(&t).arg(out);
        // SAFETY: argument types and sizes match the kernel's signature; buffers hold rows × k values.
        dev("embed", unsafe { b.launch(cfg) });
    }

    fn matmul(&self, w: &CudaMatrix, x: &CudaSlice<f32>, rows: usize, out: &mut CudaSlice<f32>) {
        let (n, k) = (w.rows, w.cols);
        let cfg = grid(n * 32, 256);
        let mut r0 = 0;
        while r0 < rows {
            let take = (rows - r0).min(MAX_ROWS);
            let xs = x.slice(r0 * k..(r0 + take) * k);
            let mut os = out.slice_mut(r0 * n..(r0 + take) * n);
            let (ty, ni, ki, ti) = (w.ty, n as i32, k as i32, take as i32);
            let mut b = self.stream.launch_builder(&self.k.matmul);
            b.arg(&w.data)
                .arg(&ty)
                .arg(&ni)
                .arg(&ki)
                .arg(&xs)
                .arg(&ti)
                .arg(&mut os);
            // SAFETY: as in `embed`; one warp per output column, `take` ≤ MAX_ROWS rows.
            dev("matmul", unsafe { b.launch(cfg) });
            r0 += take;
        }
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>, rows: usize, dim: usize) {
        let (d, n) = (dim as i32, (rows * dim) as i32);
        let mut b = self.stream.launch_builder(&self.k.add_bias);
        b.arg(x).arg(bias).arg(&d).arg(&n);
        // SAFETY: x holds rows × dim values, bias dim.
        dev("add_bias", unsafe { b.launch(grid(rows * dim, 256)) });
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
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(x).arg(w).arg(&d).arg(&eps).arg(out);
        // SAFETY: x and out hold rows × dim values; the kernel's reduction assumes 256 threads.
        dev("rms_norm", unsafe { b.launch(cfg) });
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[usize],
        n_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    ) {
        // The angles on the host, as every backend computes them.
        let half = head_dim / 2;
        let mut cs = Vec::with_capacity(positions.len() * half * 2);
        for &pos in positions {
            for i in 0..half {
                let (c, s) = crate::backend::rope_angle(pos, i, head_dim, theta);
                cs.extend([c, s]);
            }
        }
        let cs = dev("upload", self.stream.clone_htod(&cs));
        let total = positions.len() * n_heads * half;
        let (nh, hd, il, t) = (
            n_heads as i32,
            head_dim as i32,
            i32::from(style == RopeStyle::Interleaved),
            total as i32,
        );
        let mut b = self.stream.launch_builder(&self.k.rope);
        b.arg(x).arg(&cs).arg(&nh).arg(&hd).arg(&il).arg(&t);
        // SAFETY: x holds rows × n_heads × head_dim values; cs rows × half (cos, sin) pairs.
        dev("rope", unsafe { b.launch(grid(total, 256)) });
    }

    fn kv_write(
        &self,
        cache: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        slot: usize,
        rows: usize,
        kv_dim: usize,
    ) {
        self.copy(src, 0, cache, slot * kv_dim, rows * kv_dim);
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        shape: AttnShape,
        mask: &AttnMask,
        out: &mut CudaSlice<f32>,
    ) {
        let slots = shape.base + shape.rows;
        // Caches are capped to `max_attention_slots`, so this holds for every cache this backend made.
        assert!(
            slots <= self.max_attention_slots(),
            "{slots} attention slots"
        );
        let shared = (slots * 4) as u32;
        let tree: Option<CudaSlice<u8>> = match mask {
            AttnMask::Causal => None,
            AttnMask::Tree(v) => {
                let bytes: Vec<u8> = v.iter().map(|&b| u8::from(b)).collect();
                Some(dev("upload", self.stream.clone_htod(&bytes)))
            }
        };
        let (rows, nh, nkv, hd, base) = (
            shape.rows as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.base as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: ((shape.rows * shape.n_heads) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared,
        };
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&rows)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&base)
            .arg(&shape.scale);
        // A causal launch passes a null mask pointer.
        let null_ptr: u64 = 0;
        match &tree {
            Some(m) => b.arg(m),
            None => b.arg(&null_ptr),
        };
        b.arg(out);
        // SAFETY: q/out hold rows × n_heads × head_dim values, the caches (base + rows) × kv_dim; the mask is
        // rows × rows bytes or null; the scores fit the dynamic shared memory asked for.
        dev("attention", unsafe { b.launch(cfg) });
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let n = len as i32;
        let mut b = self.stream.launch_builder(&self.k.swiglu);
        b.arg(gate).arg(up).arg(&n).arg(out);
        // SAFETY: every buffer holds at least len values.
        dev("swiglu", unsafe { b.launch(grid(len, 256)) });
    }

    fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) {
        let n = len as i32;
        let mut b = self.stream.launch_builder(&self.k.add_assign);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: both buffers hold at least len values.
        dev("add_assign", unsafe { b.launch(grid(len, 256)) });
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
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}
