#!/bin/bash
# On the GPU machine: start llama.cpp's CUDA build from what `stage_gpu_peer.sh` staged in STAGE_DIR, detached
# and niced (measurements may run beside it), for sm_90. The package lands in /tmp/llpy, the wheels in
# /tmp/pydeps; the log in /tmp/llama-build.log ends with "Successfully installed" when it is done.
#
#   bash bench/peers/build_gpu_peer.sh STAGE_DIR
set -euo pipefail
stage=${1:?usage: build_gpu_peer.sh STAGE_DIR}
rm -rf /tmp/llama /tmp/llpy /tmp/pydeps
mkdir -p /tmp/llama /tmp/pydeps
tar xzf "$stage/llama-src.tgz" -C /tmp/llama
python3 -m pip install -q --no-deps --no-index --target /tmp/pydeps "$stage"/*.whl
cd /tmp/llama/llama_cpp_python-*
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=12 \
    setsid nohup nice -n 19 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/llpy . \
    > /tmp/llama-build.log 2>&1 < /dev/null &
echo "llama.cpp build started (log: /tmp/llama-build.log)"
