//! An image's pixel values for a fixed-size vision tower (SigLIP, Gemma 3's): resized to the processor's size
//! with its filter ([`super::resize`]), scaled to 0..1 and normalised per channel, channels first, with the
//! order of operations and precisions of the Hugging Face image processor the bundle names: the default
//! (torchvision) backend folds the scaling into the normalisation (`(x - 255·mean) / (255·std)` in f32, the
//! folded constants rounded to f32); the Pillow backend (`...ImageProcessorPil`) scales in f64 rounded to f32,
//! then normalises in f32.

use serde_json::Value;

use super::resize::{resize, Arithmetic, Filter, Rgb8};
use crate::error::{Error, Result};

/// A processor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct SquareProcessor {
    pub height: usize,
    pub width: usize,
    pub filter: Filter,
    /// Whose resize and scaling arithmetic: the processor backend's.
    pub arithmetic: Arithmetic,
    /// `None`: the pixels stay 0..=255.
    pub rescale: Option<f64>,
    /// Per channel, `None` without normalisation.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl SquareProcessor {
    /// The settings of a Gemma 3 or SigLIP `preprocessor_config.json` (pan-and-scan crops are not taken).
    pub fn from_config(c: &Value) -> Result<Self> {
        let bad = |m: String| Error::Invalid(format!("preprocessor_config.json: {m}"));
        let flag = |k: &str, default: bool| c.get(k).and_then(Value::as_bool).unwrap_or(default);
        if flag("do_pan_and_scan", false) {
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
        let (height, width) = (side("height")?, side("width")?);
        let code = c.get("resample").and_then(Value::as_i64).unwrap_or(2);
        let filter =
            Filter::from_pil(code).ok_or_else(|| bad(format!("resample {code} is not taken")))?;
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
        Ok(SquareProcessor {
            height,
            width,
            filter,
            arithmetic: if pillow {
                Arithmetic::Pillow
            } else {
                Arithmetic::Torchvision
            },
            rescale,
            normalize,
        })
    }

    /// The tower's input: `3 × height × width` values, channel after channel.
    pub fn pixel_values(&self, img: &Rgb8) -> Vec<f32> {
        let img = resize(img, self.width, self.height, self.filter, self.arithmetic);
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
        let plane = self.width * self.height;
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
