#!/bin/bash
# Session 7, start 3 (branch cuda-s7b): argmax over 16 blocks per row; staging lanes A/B (VERITY_CUDA_STAGE_LANES
# 4 = main, 2; VERITY_CUDA_STAGE_FROM 4 = main, 1, 0 = every launch incl. W=1). GPU tests, rowexact, rowcost
# greedy (3 rounds), ncu argmax, AR+MTP speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/n
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -v "^$" | tail -14 > $OUT/tests.txt; cat $OUT/tests.txt
echo "== rowexact"; timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tail -16 > $OUT/rowexact.txt; grep -c "bitwise equal" $OUT/rowexact.txt
echo "== rowexact lanes 2 (W=1 eight lanes)"; VERITY_CUDA_STAGE_LANES=2 timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | grep -c "bitwise equal"
for i in 1 2 3; do
for cfg in "l4f4:" "l2f4:VERITY_CUDA_STAGE_LANES=2" "l4f1:VERITY_CUDA_STAGE_FROM=1" "l4f0:VERITY_CUDA_STAGE_FROM=0" "l8:VERITY_CUDA_STAGE_LANES=8"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== greedy $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --metrics gpu__time_duration.sum -k argmax_rows --launch-count 4 --launch-skip 2 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 2 --widths $w --logits greedy 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time" >> $OUT/ncu-argmax.txt
done
cat $OUT/ncu-argmax.txt
for i in 1 2; do
for cfg in "l4f4:" "l2f4:VERITY_CUDA_STAGE_LANES=2"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== speed $name $i" >> $OUT/speed.txt; timeout 60 env $envs $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts $D/prompts.jsonl --max-tokens 128 --repeat 1 2>&1 | grep -E "^(route|ar  |mtp )" >> $OUT/speed.txt
done
done
cat $OUT/speed.txt
