//! Decoding a request's image bytes into 8-bit RGB, as the Hugging Face processors' `convert_to_rgb` sees them
//! (Pillow's `convert("RGB")`: grey replicated, palettes looked up, alpha dropped, CMYK by Pillow's formula), with
//! limits checked from the header before any pixel is decoded.
//!
//! PNG goes through the `image` crate's `png` decoder. JPEG goes through libjpeg-turbo's decoder (built from source
//! by the `mozjpeg` crate, whose decoder is libjpeg-turbo's), because that is the decoder Pillow bundles: its
//! integer inverse DCT, fancy chroma upsampling and colour conversion give Pillow's pixels bit for bit, where the
//! pure-Rust decoders (zune-jpeg, jpeg-decoder) differ by up to 4 levels on photographs. 16-bit PNGs come to 8
//! bits as Pillow brings them ([`pillow_rgb8`]), not as the `image` crate scales them.

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader, Limits};
use mozjpeg::{ColorSpace, ColorSpaceExt, Decompress};
use mozjpeg_sys::{jpeg_common_struct, jpeg_error_mgr, jpeg_std_error, JWRN_JPEG_EOF};
use std::os::raw::c_int;

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
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return decode_jpeg(bytes, limits);
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Image(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png) => {}
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
    check_size(w as usize, h as usize, limits)?;
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
        data: pillow_rgb8(img),
    })
}

/// A decoded PNG's pixels as Pillow's `convert("RGB")` gives them. 8-bit images: the `image` crate's conversion
/// is Pillow's (grey replicated, alpha dropped). 16-bit ones Pillow reads its own way: colour (with or without
/// alpha) and grey with alpha keep each value's high byte; grey alone opens as 16-bit integers, which the
/// conversion clips at 255.
fn pillow_rgb8(img: DynamicImage) -> Vec<u8> {
    let high = |v: u16| (v >> 8) as u8;
    match img {
        DynamicImage::ImageRgb16(im) => im.into_raw().into_iter().map(high).collect(),
        DynamicImage::ImageRgba16(im) => im
            .pixels()
            .flat_map(|p| [high(p[0]), high(p[1]), high(p[2])])
            .collect(),
        DynamicImage::ImageLumaA16(im) => im.pixels().flat_map(|p| [high(p[0]); 3]).collect(),
        DynamicImage::ImageLuma16(im) => {
            im.pixels().flat_map(|p| [p[0].min(255) as u8; 3]).collect()
        }
        other => other.to_rgb8().into_raw(),
    }
}

fn check_size(w: usize, h: usize, limits: &ImageLimits) -> Result<()> {
    if w == 0 || h == 0 || w > limits.max_side as usize || h > limits.max_side as usize {
        return Err(Error::Image(format!(
            "{w}×{h} pixels: each side must be 1 to {}",
            limits.max_side
        )));
    }
    if (w as u64) * (h as u64) > limits.max_pixels {
        return Err(Error::Image(format!(
            "{w}×{h} pixels, more than the {} an image may have",
            limits.max_pixels
        )));
    }
    Ok(())
}

/// A JPEG as Pillow decodes it: libjpeg's RGB output for one- and three-component images; four components are
/// CMYK (YCCK converted by libjpeg), inverted as Pillow assumes Adobe's convention, then Pillow's CMYK to RGB.
fn decode_jpeg(bytes: &[u8], limits: &ImageLimits) -> Result<Rgb8> {
    // libjpeg reports errors by unwinding out of its callbacks (`mozjpeg`'s design): caught here, the message is
    // the error. No Rust state is left half-updated across the boundary (the closure owns everything it mutates).
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let jpeg = Decompress::with_err(strict_errors())
            .from_mem(bytes)
            .map_err(|e| e.to_string())?;
        let (w, h) = jpeg.size();
        check_size(w, h, limits).map_err(|e| e.to_string())?;
        let cmyk = jpeg.color_space().num_components() == 4;
        let mut started = if cmyk {
            jpeg.to_colorspace(ColorSpace::JCS_CMYK)
        } else {
            jpeg.rgb()
        }
        .map_err(|e| e.to_string())?;
        let pixels: Vec<u8> = started.read_scanlines().map_err(|e| e.to_string())?;
        started.finish().map_err(|e| e.to_string())?;
        let data = if cmyk {
            pillow_cmyk_to_rgb(&pixels)
        } else {
            pixels
        };
        Ok::<_, String>(Rgb8 {
            width: w,
            height: h,
            data,
        })
    }));
    match decoded {
        Ok(Ok(img)) => Ok(img),
        Ok(Err(e)) => Err(Error::Image(format!("JPEG: {e}"))),
        Err(panic) => Err(Error::Image(match panic.downcast::<String>() {
            Ok(msg) => format!("JPEG: {msg}"),
            Err(_) => "JPEG: the decoder failed".into(),
        })),
    }
}

/// libjpeg's error manager with one change: data that ends before the image does is an error (Pillow: "image file
/// is truncated"), not a warning after which libjpeg would pad the picture with grey. Other warnings (stray
/// bytes, say) pass silently, as they do in Pillow.
fn strict_errors() -> jpeg_error_mgr {
    // SAFETY: an all-zero `jpeg_error_mgr` is valid (null pointers, `None` callbacks), and `jpeg_std_error` fills
    // in every field.
    let mut err: jpeg_error_mgr = unsafe { std::mem::zeroed() };
    unsafe { jpeg_std_error(&mut err) };
    err.error_exit = Some(fail);
    err.emit_message = Some(warn);
    err
}

extern "C-unwind" fn fail(cinfo: &mut jpeg_common_struct) {
    std::panic::resume_unwind(Box::new(message(cinfo)));
}

extern "C-unwind" fn warn(cinfo: &mut jpeg_common_struct, level: c_int) {
    // SAFETY: libjpeg calls this with the struct whose `err` it was given.
    let code = unsafe { (*cinfo.err).msg_code };
    if level < 0 && code == JWRN_JPEG_EOF as c_int {
        std::panic::resume_unwind(Box::new("the data ends before the image does".to_string()));
    }
}

/// libjpeg's text for the error in `cinfo`.
fn message(cinfo: &mut jpeg_common_struct) -> String {
    type Format = unsafe extern "C-unwind" fn(&mut jpeg_common_struct, &mut [u8; 80]);
    let mut buf = [0u8; 80];
    // SAFETY: `format_message` writes at most JMSG_LENGTH_MAX (80) bytes into its buffer, NUL-terminated; the
    // bindings declare the buffer `&[u8; 80]`, so the pointer is cast to the signature it has in C.
    unsafe {
        if let Some(format) = (*cinfo.err).format_message {
            let format: Format = std::mem::transmute(format);
            format(cinfo, &mut buf);
        }
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Pillow's `CMYK;I` unpacking (inverted values) and its `cmyk2rgb`: `255 - k - c·(255 - k)/255`, with its
/// rounding division by 255.
fn pillow_cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let muldiv255 = |a: i32, b: i32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    let mut rgb = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let nk = i32::from(px[3]); // 255 - (255 - raw k)
        for &raw in &px[..3] {
            let c = 255 - i32::from(raw);
            rgb.push((nk - muldiv255(c, nk)).clamp(0, 255) as u8);
        }
    }
    rgb
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
