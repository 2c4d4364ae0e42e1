#!/bin/bash
# Session 9, start 2, call C: quantization of x by the 1.5 * 2^23 rounding (no conversion unit) vs the
# rintf/F2I path (-DQ8_CONVERT). GPU tests,
# rowexact, rowcost A/B (2 rounds), ncu per launch W1/W8, AR speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9b
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
# Warm the PTX cache for each variant in parallel (NVRTC is single-threaded; the machine has 16 cores).
for opt in "" "-DQ8_CONVERT"; do
  VERITY_CUDA_NVRTC="$opt" timeout 120 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done
wait
ls /tmp/vc/cuda
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests.txt; tail -1 $OUT/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact.txt | grep -c 'bitwise equal')"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "magic:" "convert:-DQ8_CONVERT"; do
  name=${cfg%%:*}; opt=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; VERITY_CUDA_NVRTC="$opt" timeout 60 $V --device cuda $R --json $OUT/rc-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 100 $N --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --launch-skip 700 --launch-count 160 \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths $w --logits greedy 2>/dev/null | xz -c > $OUT/ncu-w$w.csv.xz
done
echo "== speed"; timeout 150 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 2>&1 | tail -15 > $OUT/speed.txt; cat $OUT/speed.txt
