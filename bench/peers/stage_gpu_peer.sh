#!/bin/bash
# Stage llama.cpp's CUDA build for a GPU machine without network access: llama-cpp-python's source distribution
# with what its build does not read removed (76.6 MB -> a few MB, small enough to travel beside a model part),
# and the wheels `run_peers.py` needs beyond that machine's Python. Run on a machine with network access:
#
#   bench/peers/stage_gpu_peer.sh OUT_DIR        # writes OUT_DIR/llama-src.tgz and OUT_DIR/*.whl
#
# On the GPU machine, `bench/peers/build_gpu_peer.sh OUT_DIR` starts the build detached (~5 min on 16 cores); poll
# /tmp/llama-build.log, then run `run_peers.py --gpu` with PYTHONPATH=/tmp/llpy:/tmp/pydeps.
# pip prepares the sdist's metadata before saving it, which needs scikit-build-core and cmake: a throwaway
# virtual environment holds them.
set -euo pipefail
VERSION=0.3.36
out=${1:?usage: stage_gpu_peer.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q scikit-build-core cmake ninja
PATH="$work/venv/bin:$PATH" "$work/venv/bin/pip" download -q --no-deps --no-build-isolation \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION"
# Not read by a CUDA build with LLAVA_BUILD=OFF as a subproject (llama.cpp's tests, tools and examples are off;
# ggml adds a backend's folder only when that backend is on).
ggml="$src/vendor/llama.cpp/ggml/src"
rm -rf "$src"/{.git,.github,docs,examples,tests,docker} \
    "$src"/vendor/llama.cpp/{.github,models,docs,benches,tests,media,examples,conversion,gguf-py,tools/ui,tools/server} \
    "$ggml"/ggml-{cann,et,hexagon,metal,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn}
tar czf "$out/llama-src.tgz" -C "$work" "llama_cpp_python-$VERSION"
"$work/venv/bin/pip" download -q --no-deps --only-binary :all: diskcache gguf -d "$out"
ls -la "$out"
