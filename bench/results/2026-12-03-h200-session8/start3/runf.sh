#!/bin/bash
# Session 8, start 3, call C (branch s8 final: narrow CTAs of 16 warps, attention split rule, wide tiles
# prefetched into shared memory, output norm fused into the output projection, attention's chunk max/sum in one
# warp). GPU tests, rowexact, rowcost A/B (2 rounds), context 1024, ncu per launch W1/W8, speed of every route.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/f8
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
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact.txt | grep -c 'bitwise equal')"
echo "llama build so far: $(tail -1 /tmp/llama-build.log)"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "final:" "nopre:VERITY_CUDA_WIDE_PREFETCH=0" "n8:VERITY_CUDA_NARROW_WARPS=8" "n32:VERITY_CUDA_NARROW_WARPS=32"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda $R --json $OUT/rowcost-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
echo "== all logits final" >> $OUT/ab.txt; timeout 40 $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits all 2>&1 | tail -6 >> $OUT/ab.txt
for cfg in "final:" "split8:VERITY_CUDA_ATT_SPLIT=8"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== context 1024 $name" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 100 $N --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --launch-skip 700 --launch-count 160 \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths $w --logits greedy 2>/dev/null | xz -c > $OUT/ncu-w$w.csv.xz
done
echo "== speed"; timeout 220 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -29 > $OUT/speed.txt; cat $OUT/speed.txt
echo "llama build: $(tail -1 /tmp/llama-build.log)"
ls -la $OUT
