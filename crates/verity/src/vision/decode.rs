//! Decoding a request's image bytes into 8-bit RGB, as the Hugging Face processors' `convert_to_rgb` sees them
//! (Pillow's `convert("RGB")`: grey replicated, palettes looked up, alpha dropped): PNG and JPEG through the
//! `image` crate (its `png` and `zune-jpeg` decoders), with limits checked from the header before any pixel is
//! decoded. 16-bit images are brought to 8 bits as the `image` crate scales them, which Pillow does not do
//! alike; 8-bit images give Pillow's pixels (PNG) or within a level of them (JPEG: the inverse DCTs differ).

use std::io::Cursor;

use image::{ImageFormat, ImageReader, Limits};

use super::resize::Rgb8;
use crate::error::{Error, Result};

/// What an image may be: bounds a request cannot exceed, checked before decoding.
#[derive(Debug, Clone, Copy)]
pub struct ImageLimits {
    /// Encoded bytes.
    pub max_bytes: usize,
    /// Width and height each.
    pub max_side: u32,
    /// Width × height.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_bytes: 20 << 20,
            max_side: 8192,
            max_pixels: 32 << 20,
        }
    }
}

/// `bytes` (a PNG or a JPEG) as 8-bit RGB, or an error that says what is wrong with it.
pub fn decode(bytes: &[u8], limits: &ImageLimits) -> Result<Rgb8> {
    if bytes.len() > limits.max_bytes {
        return Err(Error::Image(format!(
            "{} bytes, more than the {} an image may have",
            bytes.len(),
            limits.max_bytes
        )));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Image(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg) => {}
        Some(f) => {
            return Err(Error::Image(format!(
                "{f:?} images are not taken (PNG or JPEG)"
            )))
        }
        None => return Err(Error::Image("not a PNG or JPEG image".into())),
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| Error::Image(e.to_string()))?;
    if w == 0 || h == 0 || w > limits.max_side || h > limits.max_side {
        return Err(Error::Image(format!(
            "{w}×{h} pixels: each side must be 1 to {}",
            limits.max_side
        )));
    }
    if u64::from(w) * u64::from(h) > limits.max_pixels {
        return Err(Error::Image(format!(
            "{w}×{h} pixels, more than the {} an image may have",
            limits.max_pixels
        )));
    }
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Image(e.to_string()))?;
    let mut bounds = Limits::default();
    bounds.max_image_width = Some(limits.max_side);
    bounds.max_image_height = Some(limits.max_side);
    // The decoded pixels at up to 16 bits a channel with alpha, and the decoder's own buffers.
    bounds.max_alloc = Some(limits.max_pixels * 8 + (64 << 20));
    reader.limits(bounds);
    let img = reader.decode().map_err(|e| Error::Image(e.to_string()))?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    Ok(Rgb8 {
        width,
        height,
        data: img.to_rgb8().into_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_a_whole_png_or_jpeg_is_refused_with_a_reason() {
        let limits = ImageLimits::default();
        let e = decode(b"GIF89a....", &limits).unwrap_err().to_string();
        assert!(e.contains("not taken") || e.contains("not a PNG"), "{e}");
        let e = decode(&[0u8; 16], &limits).unwrap_err().to_string();
        assert!(e.contains("not a PNG"), "{e}");
        // A PNG signature and nothing after it.
        let e = decode(b"\x89PNG\r\n\x1a\n", &limits)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("image:"), "{e}");
    }
}
