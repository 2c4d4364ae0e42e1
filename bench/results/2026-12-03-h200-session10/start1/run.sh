#!/bin/bash
# Session 10, start 1, call C. Main at 8e9a3fa + this session's changes (recorded graphs evicted LRU,
# -DATT_SMEM: attention's first chunk of committed K/V copied asynchronously into shared memory before the wait
# (32 registers instead of 76), VERITY_CUDA_ATT_AHEAD_PER_SM, -DNQ_MAXNREG). Tests and rowexact under the new
# switches; rowcost A/B in 2 interleaved rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s10
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
S=$SECONDS
for opt in "" "-DATT_SMEM" "-DNQ_MAXNREG=96" "-DATT_SMEM -DNQ_MAXNREG=96"; do
  VERITY_CUDA_NVRTC="$opt" timeout 150 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done
VERITY_CUDA_NARROW_WARPS_ROWS=20 timeout 150 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
wait
echo "compiled in $((SECONDS - S)) s: $(ls /tmp/vc/cuda | wc -l) files"
for cfg in "default:" "smem:VERITY_CUDA_NVRTC=-DATT_SMEM VERITY_CUDA_ATT_AHEAD_PER_SM=64"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== tests $name"; timeout 100 env $envs /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/r/tests-$name.txt; tail -1 $OUT/r/tests-$name.txt
  echo "== rowexact $name: $(timeout 60 env $envs $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact-$name.txt | grep -c 'bitwise equal')"
done
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "full:" "smem2:VERITY_CUDA_NVRTC=-DATT_SMEM" "smemall:VERITY_CUDA_NVRTC=-DATT_SMEM VERITY_CUDA_ATT_AHEAD_PER_SM=64" \
           "regall:VERITY_CUDA_ATT_AHEAD_PER_SM=64" "cap96:VERITY_CUDA_NVRTC=-DNQ_MAXNREG=96" \
           "smemcap:VERITY_CUDA_NVRTC=-DATT_SMEM -DNQ_MAXNREG=96 VERITY_CUDA_ATT_AHEAD_PER_SM=64" "rows20:VERITY_CUDA_NARROW_WARPS_ROWS=20"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R --json $OUT/r/rc-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r && ls -la $OUT
