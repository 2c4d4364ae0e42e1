//! The CPU backend: f32 activations, weights kept in their stored format (memory-mapped), SIMD kernels chosen at
//! run time, and one persistent thread pool per backend.

mod attention;
#[cfg(target_arch = "x86_64")]
mod decode_x86;
mod matmul;
mod ops;
mod pool;
mod qmatmul;
pub mod simd;

pub use matmul::Activations;
use pool::Pool;

use crate::backend::{AttnMask, AttnShape, Backend};
use crate::error::{Error, Result};
use crate::model::hparams::RopeStyle;
use crate::quant::QMatrix;

pub struct CpuBackend {
    pool: Pool,
    activations: Activations,
}

impl CpuBackend {
    /// A backend with `threads` threads (0 = one per available core) and the default activation precision:
    /// 8-bit for the formats that have integer kernels, unless `VERITY_ACTIVATIONS=f32` asks for the f32 path.
    pub fn new(threads: usize) -> Result<Self> {
        let acts = match std::env::var("VERITY_ACTIVATIONS").as_deref() {
            Ok("f32") => Activations::F32,
            Ok("q8") | Err(_) => Activations::Q8,
            Ok(other) => {
                return Err(Error::Invalid(format!(
                    "VERITY_ACTIVATIONS={other} (expected q8 or f32)"
                )))
            }
        };
        Self::with_activations(threads, acts)
    }

    pub fn with_activations(threads: usize, activations: Activations) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = Pool::new(threads)
            .map_err(|e| Error::Invalid(format!("cannot start {threads} threads: {e}")))?;
        Ok(CpuBackend { pool, activations })
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn activations(&self) -> Activations {
        self.activations
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Matrix = QMatrix;

    fn name(&self) -> String {
        format!(
            "cpu ({:?}, {:?} activations, {} threads)",
            simd::isa(),
            self.activations,
            self.threads()
        )
    }

    fn load_matrix(&self, m: QMatrix) -> Result<QMatrix> {
        Ok(m)
    }

    fn matrix_bytes(&self, m: &QMatrix) -> usize {
        m.nbytes()
    }

    fn buffer(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn write(&self, buf: &mut Vec<f32>, data: &[f32]) {
        buf[..data.len()].copy_from_slice(data);
    }

    fn download(&self, buf: &Vec<f32>, len: usize) -> Vec<f32> {
        buf[..len].to_vec()
    }

    fn embed(&self, table: &QMatrix, tokens: &[u32], out: &mut Vec<f32>) {
        let d = table.cols;
        for (r, &t) in tokens.iter().enumerate() {
            table.dequantize_row(t as usize, &mut out[r * d..(r + 1) * d]);
        }
    }

    fn matmul(&self, w: &QMatrix, x: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        matmul::matmul(&self.pool, self.activations, w, x, rows, out)
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize, dim: usize) {
        for row in x[..rows * dim].chunks_exact_mut(dim) {
            for (a, &b) in row.iter_mut().zip(bias) {
                *a += b;
            }
        }
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        ops::rms_norm(x, w, rows, dim, eps, out)
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        positions: &[usize],
        n_heads: usize,
        head_dim: usize,
        theta: f32,
        style: RopeStyle,
    ) {
        ops::rope(x, positions, n_heads, head_dim, theta, style)
    }

    fn kv_write(
        &self,
        cache: &mut Vec<f32>,
        src: &Vec<f32>,
        slot: usize,
        rows: usize,
        kv_dim: usize,
    ) {
        cache[slot * kv_dim..(slot + rows) * kv_dim].copy_from_slice(&src[..rows * kv_dim]);
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        shape: AttnShape,
        mask: &AttnMask,
        out: &mut Vec<f32>,
    ) {
        attention::attention(&self.pool, q, k, v, shape, mask, out)
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        ops::swiglu(&gate[..len], &up[..len], &mut out[..len])
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) {
        for (a, &b) in x[..len].iter_mut().zip(&y[..len]) {
            *a += b;
        }
    }

    fn copy(&self, src: &Vec<f32>, src_off: usize, dst: &mut Vec<f32>, dst_off: usize, len: usize) {
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
    }
}
