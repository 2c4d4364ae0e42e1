#!/bin/bash
# Session 12, start 1, call C: stage the model, start llama.cpp's CUDA build (detached, niced), then the
# correctness runs (tests, rowexact) beside it; timing runs wait for the build (call D/E).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s12
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
bash bench/peers/build_gpu_peer.sh $D/llm
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "warm $SECONDS s"
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests.txt; tail -1 $OUT/tests.txt
echo "== rowexact: $(timeout 90 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/rowexact.txt | grep -c 'bitwise equal')"
echo "tests $SECONDS s; llama build: $(tail -1 /tmp/llama-build.log)"
