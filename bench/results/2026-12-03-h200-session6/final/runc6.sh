#!/bin/bash
# Call C (session 6): assemble the model; CUDA tests (MLX on the GPU, RoPE tables, fused Q/K/V+RoPE); A/B of
# x staged in one held pass or in passes, RoPE fused or not (rowcost W=1,8 interleaved, twice); rowexact; ncu per kernel W=1, W=8; speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 .device/e/p2 > $M
echo "$(cat .device/e/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc .device/e/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc .device/e/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
echo "== tests"; timeout 240 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -v "^$" | tail -14 > $OUT/tests.txt; cat $OUT/tests.txt
for i in 1 2; do
for cfg in "held:" "passes:VERITY_CUDA_STAGE_HELD=0" "held-unfused:VERITY_CUDA_FUSE_ROPE=0" "passes-unfused:VERITY_CUDA_STAGE_HELD=0 VERITY_CUDA_FUSE_ROPE=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,8,16 --repeat 9 2>&1 | tail -4 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
echo "== rowcost context 1024" >> $OUT/ab.txt; timeout 60 $V --device cuda bench rowcost --model $M --context 1024 2>&1 | tail -6 >> $OUT/ab.txt
echo "== rowexact"; timeout 100 $V --device cuda bench rowexact --model $M --prompts .device/e/prompts.jsonl 2>&1 | tail -16 > $OUT/rowexact.txt; grep -c "bitwise equal" $OUT/rowexact.txt
for w in 1 8; do
  echo "== ncu W=$w"
  VERITY_CUDA_GRAPHS=0 timeout 90 ncu --cache-control none --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 300 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --repeat 4 --widths $w 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time_duration" > $OUT/ncu-w$w.txt; cat $OUT/ncu-w$w.txt
done
echo "== speed"; timeout 170 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts .device/e/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -29 > $OUT/speed.txt; cat $OUT/speed.txt
tail -1 /tmp/llama-build.log
