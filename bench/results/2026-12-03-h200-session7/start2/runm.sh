#!/bin/bash
# Session 7, start 2 (branch cuda-s7, the merge candidate): GPU tests, rowexact, rowcost greedy A/B of the four-lane
# quantization (VERITY_CUDA_STAGE_QUADS=0 = eight lanes; 3 rounds), rowcost all,
# ncu (argmax; down projection W=1/W=8 warp states + SASS source counters), speed of every route, peers.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/m
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
for i in 1 2 3; do
for cfg in "quads:" "eight:VERITY_CUDA_STAGE_QUADS=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== greedy $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy --json $OUT/rowcost-greedy-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
echo "== all quads" >> $OUT/ab.txt; timeout 40 $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits all --json $OUT/rowcost-all.json 2>&1 | tail -6 >> $OUT/ab.txt
for cfg in "quads:" "eight:VERITY_CUDA_STAGE_QUADS=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== greedy $name context 1024" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
done
cat $OUT/ab.txt
echo "== speed"; timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -29 > $OUT/speed.txt; cat $OUT/speed.txt
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --metrics gpu__time_duration.sum -k argmax_rows --launch-count 4 --launch-skip 2 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 2 --widths $w --logits greedy 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time" >> $OUT/ncu-argmax.txt
  VERITY_CUDA_GRAPHS=0 timeout 90 ncu --cache-control none -k qmatmuls_narrow --launch-skip 123 --launch-count 1 --section WarpStateStats --section InstructionStats --section SchedulerStats --section LaunchStats \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 2 --widths $w --logits greedy > $OUT/ncu-down-w$w.txt 2>&1
  VERITY_CUDA_GRAPHS=0 timeout 90 ncu --cache-control none -k qmatmuls_narrow --launch-skip 123 --launch-count 1 --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 2 --widths $w --logits greedy > $OUT/ncu-down-src-w$w.csv 2>&1
done
for cfg in "quads:" "eight:VERITY_CUDA_STAGE_QUADS=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== ncu narrow W=8 $name" >> $OUT/ncu-narrow.txt
  env $envs VERITY_CUDA_GRAPHS=0 timeout 60 ncu --cache-control none --metrics gpu__time_duration.sum,smsp__cycles_active.avg -k qmatmuls_narrow --launch-skip 120 --launch-count 120 --print-summary per-kernel \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 2 --widths 8 --logits greedy 2>&1 | grep -E "^\s+[a-z_0-9]+ \(|gpu__time|cycles_active" >> $OUT/ncu-narrow.txt
done
cat $OUT/ncu-narrow.txt
cat $OUT/ncu-argmax.txt; grep -E "qmatmuls|Duration|Executed Instructions |Warp Cycles Per Issued|Issued Warp|No Eligible|Stall|stall" $OUT/ncu-down-w*.txt | head -60; wc -c $OUT/*.csv; head -c 600 $OUT/ncu-down-src-w8.csv
