#!/bin/bash
# Assemble the model, run the GPU tests and benches; everything to $OUT.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/mp3 || { echo "fresh machine: stage again"; exit 3; }
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/mp0 /tmp/stage/mp1 /tmp/stage/mp2 /tmp/stage/mp3 .device/e/mp4 > $M
echo "$(cat .device/e/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc .device/e/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc .device/e/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee $OUT/gpu.txt
$V fetch smollm2-135m-mtp 2>&1 | tail -2
echo "== tests"; timeout 300 /tmp/stage/cuda-test --test-threads 1 2>&1 | tail -20 | tee $OUT/tests.txt
echo "== rowcost"; timeout 60 $V --device cuda bench rowcost --model $M --json $OUT/rowcost.json 2>&1 | tail -7 | tee $OUT/rowcost.txt
echo "== rowexact"; timeout 120 $V --device cuda bench rowexact --model $M --prompts .device/e/prompts.jsonl 2>&1 | tail -16 | tee $OUT/rowexact.txt
echo "== speed"; timeout 240 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts .device/e/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -40 | tee $OUT/speed.txt
