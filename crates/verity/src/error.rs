//! The library's error type. Every failure names what failed (a file, a tensor, a setting) so a user can act
//! on it; nothing in the engine panics on bad input.

use std::path::PathBuf;

/// All errors of the verity engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS-level failure on a named file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A bundle file that is malformed: wrong magic, data outside the file, bad shapes, absurd counts.
    #[error("{}: {msg}", path.display())]
    Malformed { path: PathBuf, msg: String },
    /// A well-formed bundle that asks for something verity does not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor the architecture needs is missing or has the wrong shape.
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A request or setting outside its valid range.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// An image a request carries that cannot be taken: not a PNG or JPEG, truncated, or too large.
    #[error("image: {0}")]
    Image(String),
    /// The device failed while running a forward (a driver error after load); the forward's results are lost.
    #[error("device error: {0}")]
    Device(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn malformed(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Malformed {
            path: path.into(),
            msg: msg.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor {
            name: name.into(),
            msg: msg.into(),
        }
    }
}
