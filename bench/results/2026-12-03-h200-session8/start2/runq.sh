#!/bin/bash
# Session 8, start 2, call C (branch s8 + narrow CTAs of 16 warps by env + attention split rule): rowexact
# (rule; and 16 warps), GPU tests with 16 warps, rowcost A/B (2 rounds), context 256/1024, ncu source-level
# stall samples of a layer's four projections and its attention.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/q
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
for cfg in "rule:" "n16:VERITY_CUDA_NARROW_WARPS=16"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== rowexact $name: $(timeout 60 env $envs $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact-$name.txt | grep -c 'bitwise equal')"
done
echo "== tests n16"; VERITY_CUDA_NARROW_WARPS=16 timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -v "^$" | tail -3
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "rule:" "n16:VERITY_CUDA_NARROW_WARPS=16" "split8:VERITY_CUDA_ATT_SPLIT=8"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda $R 2>&1 | tail -6 >> $OUT/ab.txt
done
done
for c in 256 1024; do
for cfg in "rule:" "n16:VERITY_CUDA_NARROW_WARPS=16" "split8:VERITY_CUDA_ATT_SPLIT=8"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== context $c $name" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context $c --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
P="--cache-control none --clock-control none --section WarpStateStats --section SourceCounters --import-source yes"
VERITY_CUDA_GRAPHS=0 VERITY_CUDA_NVRTC=-lineinfo timeout 120 $N $P -k regex:qmatmuls_narrow --launch-skip 400 --launch-count 4 -o /tmp/narrow \
  $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths 1 --logits greedy > /dev/null 2>&1
VERITY_CUDA_GRAPHS=0 VERITY_CUDA_NVRTC=-lineinfo timeout 120 $N $P -k regex:attention --launch-skip 100 --launch-count 1 -o /tmp/att \
  $V --device cuda bench rowcost --model $M --context 256 --repeat 3 --widths 1 --logits greedy > /dev/null 2>&1
for r in narrow att; do
  $N -i /tmp/$r.ncu-rep --page details > $OUT/$r-details.txt 2>&1
  timeout 60 $N -i /tmp/$r.ncu-rep --page source --csv --print-source cuda > /tmp/$r-src.csv 2>&1
  python3 $D/topsrc.py /tmp/$r-src.csv > $OUT/$r-top.txt 2>&1; head -c 300 /tmp/$r-src.csv; echo; wc -l /tmp/$r-src.csv
done
ls -la $OUT
