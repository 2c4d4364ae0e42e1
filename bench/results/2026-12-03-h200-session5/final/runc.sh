#!/bin/bash
# Call C: assemble the model; CUDA tests; rowcost (int8 vs f32 kernels, PDL on); rowexact; ncu per kernel at W=1.
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
echo "== tests"; timeout 300 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -v "^$" | tail -12 > $OUT/tests.txt; cat $OUT/tests.txt
for cfg in "int8:" "f32:VERITY_CUDA_INT8=0" "int8-2:" "int8-nopdl:VERITY_CUDA_PDL=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== rowcost $name"; timeout 60 env $envs $V --device cuda bench rowcost --model $M --json $OUT/rowcost-$name.json 2>&1 | tail -6 > $OUT/rowcost-$name.txt; cat $OUT/rowcost-$name.txt
done
echo "== rowexact"; timeout 120 $V --device cuda bench rowexact --model $M --prompts .device/e/prompts.jsonl 2>&1 | tail -16 | grep -c "bitwise equal"
for w in 1 8; do
  echo "== ncu W=$w int8"
  VERITY_CUDA_GRAPHS=0 timeout 100 ncu --cache-control none --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 300 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --repeat 4 --widths $w 2>&1 | grep -E "^\s+[a-z_]+ \(|gpu__time_duration" > $OUT/ncu-w$w-int8.txt; cat $OUT/ncu-w$w-int8.txt
done
echo "== ncu stalls W=1 int8"
VERITY_CUDA_GRAPHS=0 timeout 120 ncu --cache-control none --section WarpStateStats --launch-skip 3000 --launch-count 60 --print-summary per-kernel \
  $V --device cuda bench rowcost --model $M --repeat 2 --widths 1 > $OUT/ncu-stalls-w1.txt 2>&1; grep -iE "^\s+[a-z_]+ \(|stall|warp cycles" $OUT/ncu-stalls-w1.txt | cut -c1-220 | head -60
echo "== speed"; timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts .device/e/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -29 > $OUT/speed.txt; cat $OUT/speed.txt
tail -1 /tmp/llama-build.log
