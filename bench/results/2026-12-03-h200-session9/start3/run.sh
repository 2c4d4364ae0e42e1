#!/bin/bash
# Session 9, start 3, call C: narrow projections' rows split into groups (a CTA per tile and group) where the
# tiles leave SMs idle. GPU tests, rowexact, rowcost A/B (2 rounds), context 1024, ncu W8, speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9c
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
VERITY_CUDA_NARROW_WARPS=24 timeout 120 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests.txt; tail -1 $OUT/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact.txt | grep -c 'bitwise equal')"
wait
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "groups:" "nogroups:VERITY_CUDA_ROW_GROUPS=1" "groups2:VERITY_CUDA_ROW_GROUPS=2" "groups4:VERITY_CUDA_ROW_GROUPS=4" "groups-nw24:VERITY_CUDA_NARROW_WARPS=24"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R --json $OUT/rc-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
for cfg in "groups:" "nogroups:VERITY_CUDA_ROW_GROUPS=1"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== context 1024 $name" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 8; do
  VERITY_CUDA_GRAPHS=0 timeout 100 $N --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --launch-skip 700 --launch-count 160 \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths $w --logits greedy 2>/dev/null | xz -c > $OUT/ncu-w$w.csv.xz
done
echo "== speed"; timeout 150 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 2>&1 | tail -22 > $OUT/speed.txt; cat $OUT/speed.txt
