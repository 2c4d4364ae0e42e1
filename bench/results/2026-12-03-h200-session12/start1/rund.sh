#!/bin/bash
# Session 12, start 1, call D: verity (the landed build) vs llama.cpp's CUDA build (started in call C), plain and
# flash attention, once the build has finished.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export VERITY_CACHE_DIR=/tmp/vc
D=.device/s12
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
test -f $M || { echo "no model: fresh machine"; exit 3; }
V=/tmp/stage/verity-cuda
for i in $(seq 1 80); do
  grep -q "Successfully installed\|ERROR\|error:" /tmp/llama-build.log && break; sleep 5
done
echo "waited $SECONDS s: $(tail -1 /tmp/llama-build.log)"
export PYTHONPATH=/tmp/llpy:/tmp/pydeps
python3 -c "import llama_cpp; print(llama_cpp.__version__)" || { tail -30 /tmp/llama-build.log; exit 5; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv
for fa in "" "--flash-attn"; do
timeout 250 python3 bench/peers/run_peers.py --gpu $fa --arms verity,llama.cpp --model $M --prompts $D/prompts.jsonl \
  --verity $V --repeat 3 --max-tokens 128 --json $OUT/peers-gpu$fa.json 2>&1 | tail -14 > $OUT/peers-gpu$fa.txt; cat $OUT/peers-gpu$fa.txt
done
echo "elapsed $SECONDS s"
