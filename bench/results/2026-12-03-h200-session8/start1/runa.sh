#!/bin/bash
# Call A: stage model parts 0-1; start llama.cpp's CUDA build detached (for the peer comparison in call D).
set -u
mkdir -p /tmp/stage && cp .device/s8a/p0 /tmp/stage/
rm -rf /tmp/llama /tmp/llpy /tmp/pydeps && mkdir -p /tmp/llama /tmp/pydeps
tar xzf .device/s8a/llama-src.tgz -C /tmp/llama
python3 -m pip install --no-deps --no-index --target /tmp/pydeps .device/s8a/*.whl 2>&1 | tail -1
cd /tmp/llama/llama_cpp_python-0.3.36
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=12 \
  setsid nohup nice -n 19 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/llpy . > /tmp/llama-build.log 2>&1 < /dev/null &
sleep 1; echo started; ls -la /tmp/stage; nvidia-smi -L
