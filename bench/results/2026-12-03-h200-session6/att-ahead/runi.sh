#!/bin/bash
# Session 6, last start: attention loading its first chunk of committed K/V before griddepcontrol.wait
# (VERITY_CUDA_ATT_AHEAD=0 = the previous order): GPU tests, rowcost A/B (3 rounds), ncu of attention, AR speed A/B.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 .device/i/p1t .device/i/p2 > $M
echo "$(cat .device/i/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc .device/i/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc .device/i/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -v "^$" | tail -14 > $OUT/tests.txt; cat $OUT/tests.txt
for i in 1 2 3; do
for cfg in "ahead:" "after:VERITY_CUDA_ATT_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,8,16 --repeat 9 2>&1 | tail -4 >> $OUT/ab.txt
done
done
for cfg in "ahead:" "after:VERITY_CUDA_ATT_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name context 1024" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
echo "== rowexact"; timeout 60 $V --device cuda bench rowexact --model $M --prompts .device/i/prompts.jsonl 2>&1 | tail -16 > $OUT/rowexact.txt; grep -c "bitwise equal" $OUT/rowexact.txt
for cfg in "ahead:" "after:VERITY_CUDA_ATT_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== ncu attention W=1,8 $name" >> $OUT/ncu.txt
  for w in 1 8; do
  env $envs VERITY_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --metrics gpu__time_duration.sum -k attention --launch-skip 500 --launch-count 60 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --repeat 4 --widths $w 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time_duration" >> $OUT/ncu.txt
  done
done
cat $OUT/ncu.txt
for i in 1 2; do
for cfg in "ahead:" "after:VERITY_CUDA_ATT_AHEAD=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== speed $name $i" >> $OUT/speed.txt; timeout 60 env $envs $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts .device/i/prompts.jsonl --max-tokens 128 --repeat 1 2>&1 | grep -E "^(route|ar  |mtp )" >> $OUT/speed.txt
done
done
cat $OUT/speed.txt
