#!/bin/bash
# Session 8, start 3, call D: verity (branch s8 final) vs llama.cpp's CUDA build (started in call A), plain and
# flash attention.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export VERITY_CACHE_DIR=/tmp/vc
D=.device/f8
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
test -f $M || { echo "no model: fresh machine"; exit 3; }
V=/tmp/stage/verity-cuda
for i in $(seq 1 60); do
  grep -q "Successfully installed\|ERROR\|error:" /tmp/llama-build.log && break; sleep 5
done
tail -1 /tmp/llama-build.log
export PYTHONPATH=/tmp/llpy:/tmp/pydeps
python3 -c "import llama_cpp; print(llama_cpp.__version__)" || exit 5
for fa in "" "--flash-attn"; do
timeout 200 python3 bench/peers/run_peers.py --gpu $fa --arms verity,llama.cpp --model $M --prompts $D/prompts.jsonl \
  --verity $V --repeat 3 --max-tokens 128 --json $OUT/peers-gpu$fa.json 2>&1 | tail -12 > $OUT/peers-gpu$fa.txt; cat $OUT/peers-gpu$fa.txt
done
