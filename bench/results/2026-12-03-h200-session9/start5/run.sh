#!/bin/bash
# Session 9, start 5, call C: the attention combine's loads side by side (vs -DATT_SERIAL_COMBINE, one L2 round
# trip per chunk) and the fused norm's weight copied into shared memory before the wait (vs -DNORM_GLOBAL).
# GPU tests, rowexact, rowcost A/B at contexts 256, 16 and 1024, knockout of attention, speed of AR/MTP/copy.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9e
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
for opt in "" "-DATT_SERIAL_COMBINE" "-DNORM_GLOBAL" "-DATT_SERIAL_COMBINE -DNORM_GLOBAL" "-DKO_ATT"; do
  VERITY_CUDA_NVRTC="$opt" timeout 150 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done
wait
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"
for ctx in 256 16 1024; do
R="bench rowcost --model $M --context $ctx --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "new:" "serial:-DATT_SERIAL_COMBINE" "normglobal:-DNORM_GLOBAL" "old:-DATT_SERIAL_COMBINE -DNORM_GLOBAL" "ko_att:-DKO_ATT"; do
  name=${cfg%%:*}; opt=${cfg#*:}
  [ $ctx != 256 ] && [ $name = normglobal ] && continue
  echo "== ctx $ctx $name $i" >> $OUT/ab.txt; VERITY_CUDA_NVRTC="$opt" timeout 60 $V --device cuda $R --json $OUT/r/rc-$ctx-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
done
cat $OUT/ab.txt
echo "== speed"; timeout 220 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/r/speed.json 2>&1 | tail -22 > $OUT/r/speed.txt; cat $OUT/r/speed.txt
cd $OUT && tar cJf r.tar.xz r && rm -rf r && ls -la $OUT
