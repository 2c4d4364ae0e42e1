//! Resampling of 8-bit RGB images, value for value what the Hugging Face image processors compute: their
//! torchvision backend (transformers' default: `torchvision.transforms.v2.functional.resize` with antialiasing,
//! PyTorch's uint8 kernel) or their Pillow backend (`Image.resize`). A model sees the same pixels here only if
//! every rounding step is theirs.
//!
//! Both are the same separable convolution: horizontal pass first into an 8-bit image of the rows the vertical
//! pass reads, then the vertical pass. Each output pixel's filter is centred on its box in the input and widened
//! by the scale when shrinking (antialiasing); its weights are computed in f64 and normalised to sum 1, then
//! turned into fixed point; a pass sums `pixel × weight` in 32-bit integers from half a unit and clamps
//! `sum >> bits` to 0..=255. They differ in the fixed point: Pillow's weights have 22 fraction bits, rounded half
//! away from zero; PyTorch's are 16-bit integers with as many fraction bits as the axis's largest weight allows,
//! rounded half up. Written by hand because no image crate reproduces either (the `image` crate's filters round
//! differently).

/// Whose fixed-point arithmetic a resize reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arithmetic {
    /// PyTorch's uint8 antialiased kernel: what transformers' default (torchvision) processors compute.
    Torchvision,
    /// Pillow's `Image.resize`: what transformers' Pillow processors compute.
    Pillow,
}

/// A resampling filter: Pillow's `BILINEAR` (what Gemma 3's and SigLIP's processors use) or `BICUBIC` (Qwen2-VL's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
}

impl Filter {
    /// Pillow's resample code (`PIL.Image.Resampling`), as processor configs write it.
    pub fn from_pil(code: i64) -> Option<Filter> {
        match code {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            // Keys' cubic convolution with a = -0.5.
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// Pillow's fraction bits: 32-bit sums of 8-bit pixels with room for negative lobes and overshoot.
const PILLOW_BITS: u32 = 32 - 8 - 2;

/// The weights of every output pixel along one axis: pixel `o` reads inputs `first[o]..first[o] + count[o]`
/// with the weights `weights[o * width..][..count[o]]` (fixed point, `bits` fraction bits).
struct Taps {
    first: Vec<usize>,
    count: Vec<usize>,
    width: usize,
    weights: Vec<i32>,
    bits: u32,
}

fn taps(in_size: usize, out_size: usize, filter: Filter, arith: Arithmetic) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let width = support.ceil() as usize * 2 + 1;
    let mut first = Vec::with_capacity(out_size);
    let mut count = Vec::with_capacity(out_size);
    let mut real = vec![0f64; out_size * width];
    let mut largest = 0f64;
    for o in 0..out_size {
        let center = (o as f64 + 0.5) * scale;
        // Truncated toward zero, then clamped to the image.
        let lo = ((center - support + 0.5) as i64).max(0) as usize;
        let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = hi.saturating_sub(lo).min(width);
        let w = &mut real[o * width..][..n];
        let mut sum = 0.0;
        for (i, wi) in w.iter_mut().enumerate() {
            *wi = filter.weight(((i + lo) as f64 - center + 0.5) / filterscale);
            sum += *wi;
        }
        if sum != 0.0 {
            for wi in w.iter_mut() {
                *wi /= sum;
                largest = largest.max(*wi);
            }
        }
        first.push(lo);
        count.push(n);
    }
    let bits = match arith {
        Arithmetic::Pillow => PILLOW_BITS,
        // The most fraction bits that keep the largest weight below 2^15 (an i16), at most 22.
        Arithmetic::Torchvision => (0..22)
            .find(|&b| (0.5 + largest * f64::from(1u32 << (b + 1))) as i64 >= 1 << 15)
            .unwrap_or(22)
            .max(1),
    };
    let one = f64::from(1u32 << bits);
    let weights = real
        .iter()
        .map(|&w| match arith {
            Arithmetic::Pillow if w < 0.0 => (-0.5 + w * one) as i32,
            Arithmetic::Pillow => (0.5 + w * one) as i32,
            Arithmetic::Torchvision => (0.5 + w * one).floor() as i32,
        })
        .collect();
    Taps {
        first,
        count,
        width,
        weights,
        bits,
    }
}

/// `sum >> bits` clamped to a byte.
fn clip8(sum: i32, bits: u32) -> u8 {
    (sum >> bits).clamp(0, 255) as u8
}

/// An 8-bit RGB image, row-major, 3 bytes a pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb8 {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// `img` resized to `width × height` with `filter`, in `arith`'s arithmetic.
pub fn resize(img: &Rgb8, width: usize, height: usize, filter: Filter, arith: Arithmetic) -> Rgb8 {
    assert!(width > 0 && height > 0 && img.width > 0 && img.height > 0);
    let vert = taps(img.height, height, filter, arith);
    // The rows of the input the vertical pass reads.
    let row0 = vert.first[0];
    let row1 = vert.first[height - 1] + vert.count[height - 1];
    let mid = if width != img.width {
        let horiz = taps(img.width, width, filter, arith);
        let half = 1i32 << (horiz.bits - 1);
        let mut mid = Rgb8 {
            width,
            height: row1 - row0,
            data: vec![0; width * (row1 - row0) * 3],
        };
        for y in 0..mid.height {
            let src = &img.data[(y + row0) * img.width * 3..][..img.width * 3];
            let dst = &mut mid.data[y * width * 3..][..width * 3];
            for x in 0..width {
                let k = &horiz.weights[x * horiz.width..][..horiz.count[x]];
                let mut s = [half; 3];
                for (i, &w) in k.iter().enumerate() {
                    let p = &src[(horiz.first[x] + i) * 3..][..3];
                    for c in 0..3 {
                        s[c] += i32::from(p[c]) * w;
                    }
                }
                for c in 0..3 {
                    dst[x * 3 + c] = clip8(s[c], horiz.bits);
                }
            }
        }
        Some(mid)
    } else {
        None
    };
    // Without a horizontal pass the vertical one reads the input itself, from its first row.
    let (src, base) = match &mid {
        Some(m) => (m, row0),
        None => (img, 0),
    };
    if height == img.height {
        return src.clone();
    }
    let mut out = Rgb8 {
        width,
        height,
        data: vec![0; width * height * 3],
    };
    let stride = width * 3;
    let half = 1i32 << (vert.bits - 1);
    for y in 0..height {
        let k = &vert.weights[y * vert.width..][..vert.count[y]];
        let first = vert.first[y] - base;
        let dst = &mut out.data[y * stride..][..stride];
        for (v, d) in dst.iter_mut().enumerate() {
            let mut s = half;
            for (i, &w) in k.iter().enumerate() {
                s += i32::from(src.data[(first + i) * stride + v]) * w;
            }
            *d = clip8(s, vert.bits);
        }
    }
    out
}
