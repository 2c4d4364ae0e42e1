#!/usr/bin/env bash
# llama.cpp's CUDA build (libllama for run_peers.py --gpu, and llama-server for bench/load/vs_llama_server.py
# --gpu) made on a machine without a GPU or a CUDA toolkit, for a GPU machine that has the CUDA 13 driver and
# runtime: the toolkit (nvcc, headers, cuBLAS) comes from NVIDIA's PyPI wheels, and the driver library is linked
# through a stub that names the few entry points ggml-cuda calls (the real libcuda.so.1 is loaded at run time).
#
#   bench/peers/build_llama_cuda.sh OUT.tar.xz [ARCH]     (ARCH: CUDA architecture, default 90 = H100/H200)
#
# On the GPU machine: tar xJf OUT.tar.xz -C DIR; LD_LIBRARY_PATH=DIR/bin:/usr/local/cuda/lib64; then
# LLAMA_CPP_LIB_PATH=DIR/bin for llama-cpp-python's bindings, DIR/bin/llama-server for the server.
set -euo pipefail
out=$(realpath -m "${1:?usage: build_llama_cuda.sh OUT.tar.xz [ARCH]}")
arch=${2:-90}
work=${WORK:-/tmp/llama-cuda-build}
mkdir -p "$work/wheels"
cd "$work"
python3 -m pip download -q --no-deps -d wheels "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" \
    "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*" "nvidia-cuda-cccl==13.0.*"
python3 -m pip install -q --no-deps --no-index --target toolkit wheels/*.whl
cuda=$work/toolkit/nvidia/cu13
# nvcc looks for lib64; CMake for unversioned libraries.
ln -sfn lib "$cuda/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$cuda/lib/lib$l.so"; done
mkdir -p "$cuda/lib/stubs"
printf 'int %s(void) { return 0; }\n' cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree \
    cuMemAddressReserve cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess \
    cuMemUnmap cuDriverGetVersion cuInit cuCtxGetCurrent cuGetProcAddress > stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 stub.c -o "$cuda/lib/stubs/libcuda.so"
# The llama.cpp tree that llama-cpp-python 0.3.36 vendors (the version run_peers.py's CPU arm uses).
test -d llama_cpp_python-0.3.36 || {
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d sdist llama-cpp-python==0.3.36
    tar xzf sdist/llama_cpp_python-0.3.36.tar.gz
}
test -x venv/bin/cmake || { python3 -m venv venv && venv/bin/pip install -q cmake ninja; }
export PATH=$work/venv/bin:$cuda/bin:$PATH LD_LIBRARY_PATH=$cuda/lib
cd llama_cpp_python-0.3.36/vendor/llama.cpp
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DCUDAToolkit_ROOT="$cuda" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/cmake.log"
cmake --build build --target llama llama-server > "$work/build.log"
rm -rf "$work/pack" && mkdir -p "$work/pack/bin"
cp -a build/bin/*.so* build/bin/llama-server "$work/pack/bin/"
strip --strip-unneeded "$work"/pack/bin/*.so.* "$work/pack/bin/llama-server"
tar cf - -C "$work/pack" bin | xz -T0 -6 > "$out"
echo "wrote $out"
