//! Images in a conversation: their bytes decoded and preprocessed into the pixel values a vision tower reads,
//! value for value what the Hugging Face processors of the same model give for the same image.

pub mod decode;
mod layers;
pub mod preprocess;
pub mod qwen25;
pub mod resize;
pub mod siglip;

pub use decode::{decode, ImageLimits};
pub use preprocess::{GridProcessor, PixelValues, SquareProcessor};
pub use qwen25::{Qwen25Vision, Qwen25VisionConfig};
pub use resize::{resize, Arithmetic, Filter, Rgb8};
pub use siglip::{Gemma3Vision, SiglipConfig};
