#!/bin/bash
# Session 8, start 1, call C (branch s8: output norm fused into the output projection, attention's chunk
# max/sum in one warp, attention split from the host, NVRTC options and the launch floor by env).
# GPU tests, rowexact, rowcost A/B (split, floor, PDL), context 1024 split, ncu per launch W1/W8, one narrow
# launch in detail.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s8
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
# Measurements start once llama.cpp's build (call A) has finished, so it does not load the host.
for i in $(seq 1 60); do grep -q "Successfully installed\|ERROR\|error:" /tmp/llama-build.log 2>/dev/null && break; sleep 5; done
echo "llama build: $(tail -1 /tmp/llama-build.log)"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "split8:" "split16:VERITY_CUDA_ATT_SPLIT=16" "split4:VERITY_CUDA_ATT_SPLIT=4" "floor:VERITY_CUDA_NVRTC=-DLAUNCH_FLOOR" "floor-nopdl:VERITY_CUDA_NVRTC=-DLAUNCH_FLOOR VERITY_CUDA_PDL=0" "nopdl:VERITY_CUDA_PDL=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda $R 2>&1 | tail -6 >> $OUT/ab.txt
done
done
for cfg in "split8:" "split16:VERITY_CUDA_ATT_SPLIT=16" "split32:VERITY_CUDA_ATT_SPLIT=32"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== context 1024 $name" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 120 $N --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --launch-skip 700 --launch-count 160 \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths $w --logits greedy > $OUT/ncu-w$w.csv 2>/dev/null
  echo "ncu w$w: $(wc -l < $OUT/ncu-w$w.csv) lines"
done
VERITY_CUDA_GRAPHS=0 VERITY_CUDA_NVRTC=-lineinfo timeout 150 $N --set full --import-source yes -k regex:qmatmuls_narrow --launch-skip 400 --launch-count 4 -o /tmp/narrow \
  $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths 1 --logits greedy > /dev/null 2>&1
$N -i /tmp/narrow.ncu-rep --page details > $OUT/narrow-details.txt 2>&1
timeout 60 $N -i /tmp/narrow.ncu-rep --page source --csv --print-source cuda,sass > $OUT/narrow-source.csv 2>&1 || echo "no source page"
ls -la $OUT
