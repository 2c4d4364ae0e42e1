#!/bin/bash
# Session 9, first start, call C (branch next-s9 at 9cabe93: kernels' PTX cached between runs; 24-warp
# projection CTAs for launches of 4+ rows). Cold vs warm start time, GPU tests, rowexact, rowcost A/B.
# Stage first: .device/qa/runa.sh (p0), .device/b2/runb.sh (p1).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
for run in cold warm warm2; do
  [ $run = cold ] && rm -rf /tmp/vc/cuda
  s=$EPOCHREALTIME; $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1; e=$EPOCHREALTIME
  echo "start $run: $(awk "BEGIN{print $e - $s}") s" | tee -a $OUT/start.txt
done
ls -la /tmp/vc/cuda | tee -a $OUT/start.txt
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests.txt; tail -1 $OUT/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact.txt | grep -c 'bitwise equal')"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "rows24:" "rows16:VERITY_CUDA_NARROW_WARPS_ROWS=16"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
echo "== speed"; timeout 220 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 2>&1 | tail -22 > $OUT/speed.txt; cat $OUT/speed.txt
