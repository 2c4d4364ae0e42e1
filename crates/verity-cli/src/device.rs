//! `--device`: which backend runs the model. Commands written once against `Backend` are instantiated per
//! backend through [`WithBackend`] (a generic function cannot be passed as a closure).

use std::sync::Arc;

use anyhow::Result;
use verity::backend::cpu::CpuBackend;
use verity::backend::Backend;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// GPU 0 where this build has the CUDA backend and the machine a usable GPU; the CPU otherwise.
    #[default]
    Auto,
    /// The CPU backend (every command).
    Cpu,
    /// The CUDA backend on GPU 0 (`run`, `chat`, `serve`, `bench`; needs a build with
    /// `--features cuda`); an error where there is none.
    Cuda,
}

/// A command body generic over the backend.
pub trait WithBackend {
    type Out;
    /// `device`: the one chosen (`Cpu` or `Cuda`, never `Auto`).
    fn run<B: Backend>(self, backend: Arc<B>, device: Device) -> Result<Self::Out>;
}

/// Run `body` on the chosen device.
pub fn with_backend<W: WithBackend>(device: Device, threads: usize, body: W) -> Result<W::Out> {
    match device {
        Device::Cpu => body.run(Arc::new(CpuBackend::new(threads)?), Device::Cpu),
        Device::Cuda => cuda(body),
        Device::Auto => {
            #[cfg(feature = "cuda")]
            match verity::backend::cuda::CudaBackend::new(0) {
                Ok(backend) => {
                    eprintln!("device: {}", backend.name());
                    return body.run(Arc::new(backend), Device::Cuda);
                }
                Err(e) => eprintln!("device: cpu (no usable GPU: {e})"),
            }
            body.run(Arc::new(CpuBackend::new(threads)?), Device::Cpu)
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda<W: WithBackend>(body: W) -> Result<W::Out> {
    let backend = verity::backend::cuda::CudaBackend::new(0)?;
    eprintln!("device: {}", backend.name());
    body.run(Arc::new(backend), Device::Cuda)
}

#[cfg(not(feature = "cuda"))]
fn cuda<W: WithBackend>(_: W) -> Result<W::Out> {
    anyhow::bail!(
        "this verity was built without the CUDA backend: cargo build --release -p verity-cli --features cuda"
    )
}

/// Commands that run on the CPU only say so instead of silently ignoring `--device cuda`.
pub fn cpu_only(device: Device, command: &str) -> Result<()> {
    if device == Device::Cuda {
        anyhow::bail!("`{command}` runs on the CPU only (--device cuda: run, chat, serve, bench)");
    }
    Ok(())
}
