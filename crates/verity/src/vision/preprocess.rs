//! An image's pixel values for a vision tower: for a fixed-size tower (SigLIP, Gemma 3's) resized to the
//! processor's size, for a tower that takes images near their own size (Qwen2.5-VL's) resized to a grid of
//! patches and cut into them; with the processor's filter ([`super::resize`]), scaled to 0..1 and normalised
//! per channel, channels first, with the
//! order of operations and precisions of the Hugging Face image processor the bundle names: the default
//! (torchvision) backend folds the scaling into the normalisation (`(x - 255·mean) / (255·std)` in f32, the
//! folded constants rounded to f32); the Pillow backend (`...ImageProcessorPil`) scales in f64 rounded to f32,
//! then normalises in f32.

use serde_json::Value;

use super::resize::{resize, Arithmetic, Filter, Rgb8};
use crate::error::{Error, Result};

/// A fixed-size tower's processor settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct SquareProcessor {
    pub height: usize,
    pub width: usize,
    pub filter: Filter,
    pub values: PixelValues,
}

impl SquareProcessor {
    /// The settings of a Gemma 3 or SigLIP `preprocessor_config.json` (pan-and-scan crops are not taken).
    pub fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("preprocessor_config.json: {m}"));
        if c.get("do_pan_and_scan").and_then(Value::as_bool) == Some(true) {
            return Err(Error::Unsupported(
                "pan-and-scan image crops (do_pan_and_scan)".into(),
            ));
        }
        let size = c.get("size").ok_or_else(|| bad("no size".into()))?;
        let side = |k: &str| {
            size.get(k)
                .and_then(Value::as_u64)
                .filter(|&v| (1..=4096).contains(&v))
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("size.{k} must be 1 to 4096")))
        };
        Ok(SquareProcessor {
            height: side("height")?,
            width: side("width")?,
            filter: filter(c, 2)?,
            values: PixelValues::from_config(c)?,
        })
    }

    /// The tower's input: `3 × height × width` values, channel after channel.
    pub fn pixel_values(&self, img: &Rgb8) -> Vec<f32> {
        let img = resize(
            img,
            self.width,
            self.height,
            self.filter,
            self.values.arithmetic,
        );
        self.values.planes(&img)
    }
}

/// The resampling filter a config names (`resample`, Pillow's code), `default` where it names none.
fn filter(c: &Value, default: i64) -> Result<Filter> {
    let code = c.get("resample").and_then(Value::as_i64).unwrap_or(default);
    Filter::from_pil(code).ok_or_else(|| {
        Error::Invalid(format!(
            "preprocessor_config.json: resample {code} is not taken"
        ))
    })
}

/// A processor for a tower that takes images at (nearly) their own size in patches (Qwen2-VL's and
/// Qwen2.5-VL's): the image resized to the nearest multiples of a merged patch whose area lies within bounds
/// (`smart_resize`), then cut into patches, each repeated over the tower's temporal patch, the patches of each
/// merged square consecutive.
#[derive(Debug, Clone, PartialEq)]
pub struct GridProcessor {
    pub patch: usize,
    /// Patches merged, per side, into one of the text model's rows.
    pub merge: usize,
    /// Frames a patch spans (an image's one frame repeated).
    pub temporal: usize,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub filter: Filter,
    pub values: PixelValues,
}

impl GridProcessor {
    /// The settings of a Qwen2-VL or Qwen2.5-VL `preprocessor_config.json`: bounds as `size.shortest_edge` /
    /// `size.longest_edge` (transformers 5) or `min_pixels` / `max_pixels` (published checkpoints).
    pub fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("preprocessor_config.json: {m}"));
        let count = |v: Option<&Value>, k: &str, default: u64| -> Result<usize> {
            match v {
                None => Ok(default as usize),
                Some(v) => v
                    .as_u64()
                    .filter(|&x| (1..=1 << 30).contains(&x))
                    .map(|x| x as usize)
                    .ok_or_else(|| bad(format!("{k} must be a positive count"))),
            }
        };
        let size = c.get("size");
        let bound = |sized: &str, flat: &str, default: u64| {
            let v = size.and_then(|s| s.get(sized)).or_else(|| c.get(flat));
            count(v, flat, default)
        };
        let p = GridProcessor {
            patch: count(c.get("patch_size"), "patch_size", 14)?,
            merge: count(c.get("merge_size"), "merge_size", 2)?,
            temporal: count(c.get("temporal_patch_size"), "temporal_patch_size", 2)?,
            min_pixels: bound("shortest_edge", "min_pixels", 56 * 56)?,
            max_pixels: bound("longest_edge", "max_pixels", 28 * 28 * 1280)?,
            filter: filter(c, 3)?,
            values: PixelValues::from_config(c)?,
        };
        if p.patch > 64 || p.merge > 8 || p.temporal > 8 || p.min_pixels > p.max_pixels {
            return Err(bad(format!(
                "patch {} merged {} x {} over {} frames, {} to {} pixels",
                p.patch, p.merge, p.merge, p.temporal, p.min_pixels, p.max_pixels
            )));
        }
        Ok(p)
    }

    /// The size (`[height, width]`) an image of `height × width` pixels is resized to: each side a multiple
    /// of a merged patch, the area within the bounds, the aspect ratio kept as nearly as that allows —
    /// transformers' `smart_resize`, in its f64 arithmetic (Python's `round` rounds halves to even). An
    /// aspect ratio beyond 200 is refused, as there.
    pub fn resized(&self, height: usize, width: usize) -> Result<[usize; 2]> {
        let factor = (self.patch * self.merge) as f64;
        let (h, w) = (height as f64, width as f64);
        if height == 0 || width == 0 || h.max(w) / h.min(w) > 200.0 {
            return Err(Error::Image(format!(
                "an image of {width} x {height} pixels (aspect ratios up to 200 are taken)"
            )));
        }
        let mut hb = (h / factor).round_ties_even() * factor;
        let mut wb = (w / factor).round_ties_even() * factor;
        if hb * wb > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            hb = factor.max((h / beta / factor).floor() * factor);
            wb = factor.max((w / beta / factor).floor() * factor);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            hb = (h * beta / factor).ceil() * factor;
            wb = (w * beta / factor).ceil() * factor;
        }
        Ok([hb as usize, wb as usize])
    }

    /// The grid of patches (`[rows, columns]`) an image of `height × width` pixels becomes.
    pub fn grid(&self, height: usize, width: usize) -> Result<[usize; 2]> {
        let [h, w] = self.resized(height, width)?;
        Ok([h / self.patch, w / self.patch])
    }

    /// Values per patch: channels × frames × patch × patch.
    pub fn patch_values(&self) -> usize {
        3 * self.temporal * self.patch * self.patch
    }

    /// The tower's input for `img` and its grid of patches: one row of [`GridProcessor::patch_values`] per
    /// patch (channel, frame, row, column; the frames repeat the image), the patches merged square by merged
    /// square, row-major over the squares and within each.
    pub fn pixel_values(&self, img: &Rgb8) -> Result<(Vec<f32>, [usize; 2])> {
        let [height, width] = self.resized(img.height, img.width)?;
        let img = resize(img, width, height, self.filter, self.values.arithmetic);
        let planes = self.values.planes(&img);
        let (p, m, t) = (self.patch, self.merge, self.temporal);
        let [rows, cols] = [height / p, width / p];
        let mut out = Vec::with_capacity(rows * cols * self.patch_values());
        for by in 0..rows / m {
            for bx in 0..cols / m {
                for my in 0..m {
                    for mx in 0..m {
                        let (py, px) = (by * m + my, bx * m + mx);
                        for c in 0..3 {
                            for _ in 0..t {
                                for y in 0..p {
                                    let at = c * height * width + (py * p + y) * width + px * p;
                                    out.extend_from_slice(&planes[at..at + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok((out, [rows, cols]))
    }
}

/// How a processor turns 8-bit pixels into values: scaled and normalised per channel in its backend's order of
/// operations and precisions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PixelValues {
    /// Whose resize and scaling arithmetic: the processor backend's.
    pub arithmetic: Arithmetic,
    /// `None`: the pixels stay 0..=255.
    pub rescale: Option<f64>,
    /// Per channel, `None` without normalisation.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl PixelValues {
    /// The settings `rescale`, `rescale_factor`, `do_normalize`, `image_mean`, `image_std` and the backend the
    /// processor's type names, from a `preprocessor_config.json`.
    fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("preprocessor_config.json: {m}"));
        let flag = |k: &str, default: bool| c.get(k).and_then(Value::as_bool).unwrap_or(default);
        let rescale = if flag("do_rescale", true) {
            let f = c
                .get("rescale_factor")
                .and_then(Value::as_f64)
                .unwrap_or(1.0 / 255.0);
            Some(f)
        } else {
            None
        };
        let triple = |k: &str| -> Result<[f32; 3]> {
            let v = c
                .get(k)
                .and_then(Value::as_array)
                .filter(|a| a.len() == 3)
                .ok_or_else(|| bad(format!("{k} must hold 3 numbers")))?;
            let mut out = [0f32; 3];
            for (o, x) in out.iter_mut().zip(v) {
                *o = x
                    .as_f64()
                    .ok_or_else(|| bad(format!("{k}: not a number")))? as f32;
            }
            Ok(out)
        };
        let normalize = if flag("do_normalize", true) {
            let std = triple("image_std")?;
            if std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
                return Err(bad("image_std must be finite and non-zero".into()));
            }
            Some((triple("image_mean")?, std))
        } else {
            None
        };
        let pillow = c
            .get("image_processor_type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.ends_with("Pil"));
        Ok(PixelValues {
            arithmetic: if pillow {
                Arithmetic::Pillow
            } else {
                Arithmetic::Torchvision
            },
            rescale,
            normalize,
        })
    }

    /// `img`'s values, `3 × height × width`, channel after channel.
    fn planes(&self, img: &Rgb8) -> Vec<f32> {
        // Per channel: v = (x · scale − offset) / divisor, each step as the backend rounds it.
        let per_channel = |c: usize| -> (f32, f32) {
            match (self.arithmetic, self.rescale, &self.normalize) {
                // torchvision folds the scaling into the normalisation (f32 tensors times the f64 scalar,
                // which torch rounds to f32 first).
                (Arithmetic::Torchvision, Some(f), Some((mean, std))) => {
                    let k = (1.0 / f) as f32;
                    (mean[c] * k, std[c] * k)
                }
                (_, _, Some((mean, std))) => (mean[c], std[c]),
                (_, _, None) => (0.0, 1.0),
            }
        };
        let plane = img.width * img.height;
        let mut out = vec![0f32; 3 * plane];
        for c in 0..3 {
            let (offset, divisor) = per_channel(c);
            for (o, p) in out[c * plane..][..plane]
                .iter_mut()
                .zip(img.data.chunks_exact(3))
            {
                let x = p[c];
                let v = match (self.arithmetic, self.rescale, self.normalize.is_some()) {
                    (Arithmetic::Torchvision, Some(_), true) | (_, None, _) => f32::from(x),
                    (Arithmetic::Torchvision, Some(f), false) => f32::from(x) * f as f32,
                    (Arithmetic::Pillow, Some(f), _) => (f64::from(x) * f) as f32,
                };
                *o = if self.normalize.is_some() {
                    (v - offset) / divisor
                } else {
                    v
                };
            }
        }
        out
    }
}
