#!/bin/bash
# Session 7, start 1 (branch cuda-s7): attention's early-load variant only for small grids, x copied into shared
# memory in one pass for launches of >= 2 rows (VERITY_CUDA_X_COPY_FROM), the residual read before staging
# (VERITY_CUDA_RES_AHEAD=0 = at the store). GPU tests, rowexact, rowcost A/B (2 rounds), layers-only rowcost,
# greedy (device argmax) rowcost, ncu per kernel W=1/8, AR+MTP speed (greedy: the device argmax path).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/k
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
for i in 1 2; do
for cfg in "base:" "nocopy:VERITY_CUDA_X_COPY_FROM=99" "copy1:VERITY_CUDA_X_COPY_FROM=1" "nores:VERITY_CUDA_RES_AHEAD=0" "never:VERITY_CUDA_ATT_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 9 2>&1 | tail -6 >> $OUT/ab.txt
done
done
for i in 1 2; do
for cfg in "base:" "nocopy:VERITY_CUDA_X_COPY_FROM=99"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name greedy $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 9 --logits greedy 2>&1 | tail -6 >> $OUT/ab.txt
  echo "== $name layers only $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 9 --logits none 2>&1 | tail -6 >> $OUT/ab.txt
done
done
for cfg in "base:" "nocopy:VERITY_CUDA_X_COPY_FROM=99"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name context 1024 greedy" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
for cfg in "base:" "nocopy:VERITY_CUDA_X_COPY_FROM=99"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== ncu per kernel W=1,8 $name" >> $OUT/ncu.txt
  for w in 1 8; do
  env $envs VERITY_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --metrics gpu__time_duration.sum --launch-skip 500 --launch-count 150 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --repeat 4 --widths $w 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time_duration" >> $OUT/ncu.txt
  done
done
cat $OUT/ncu.txt
for i in 1 2; do
for cfg in "base:" "nocopy:VERITY_CUDA_X_COPY_FROM=99 VERITY_CUDA_RES_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== speed $name $i" >> $OUT/speed.txt; timeout 60 env $envs $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts $D/prompts.jsonl --max-tokens 128 --repeat 1 2>&1 | grep -E "^(route|ar  |mtp )" >> $OUT/speed.txt
done
done
cat $OUT/speed.txt
