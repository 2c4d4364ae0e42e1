//! Kernel launches through `cuLaunchKernelEx`, so that a launch can carry the programmatic-stream-serialization
//! attribute (Hopper's programmatic dependent launch): the next kernel's blocks start while this one runs, fetch
//! their weights, and wait in `griddepcontrol.wait` (`kernels.cu`'s `wait_inputs`) for this one's results.
//! cudarc's launch builder takes no launch attributes, hence this small launcher.

use std::ffi::c_void;

use cudarc::driver::sys::{
    cuLaunchKernelEx, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig,
};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};

/// One kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A device address.
    Ptr(u64),
    I32(i32),
    F32(f32),
    /// A struct parameter's bytes (the driver copies as many as the kernel's parameter takes).
    Words(&'a [u64]),
}

/// The device address of `s`'s element `at`.
pub fn addr<T>(stream: &CudaStream, s: &CudaSlice<T>, at: usize) -> Arg<'static> {
    debug_assert!(at <= s.len());
    // With event tracking disabled (one stream orders everything) the guard does nothing.
    let (p, _guard) = s.device_ptr(stream);
    Arg::Ptr(p + (at * std::mem::size_of::<T>()) as u64)
}

/// Launch `f` on `stream` with `args` (types and order exactly the kernel's parameters), with programmatic
/// dependent launch when `pdl`.
///
/// # Safety
/// The arguments must match the kernel's signature, and every address must be valid for what the kernel
/// reads and writes under `cfg`.
pub unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    args: &[Arg],
) -> Result<(), cudarc::driver::DriverError> {
    // Each scalar parameter's bytes at the start of an 8-byte slot (little-endian: an i32 is its low half).
    let mut slots: Vec<u64> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(p) => p,
            Arg::I32(v) => u64::from(v as u32),
            Arg::F32(v) => u64::from(v.to_bits()),
            Arg::Words(_) => 0,
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .zip(args)
        .map(|(s, a)| match a {
            Arg::Words(w) => w.as_ptr() as *mut c_void,
            _ => s as *mut u64 as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute is a valid value of the C struct; the one field used is set below.
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(pdl),
    };
    stream.context().bind_to_thread()?;
    // SAFETY: the caller vouches for the arguments; `params` points into `slots` and `args`' words, all alive
    // across the call (the driver copies the parameters before returning; it only reads them).
    unsafe {
        cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}
