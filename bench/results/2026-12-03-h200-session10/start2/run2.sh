#!/bin/bash
# Session 10, start 2: ended sessions' caches reused by new ones (graphs replayed, not re-recorded per
# request): every route's speed twice with the graph store's counts; attention split forced at context 1024.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s10
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "== tests"; timeout 100 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests.txt; tail -1 $OUT/tests.txt
for i in 1 2; do
  VERITY_LOG=verity=debug timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/speed-$i.json > $OUT/speed-$i.txt 2> /tmp/speed-log-$i.txt
  grep -v "CUDA graph recorded" /tmp/speed-log-$i.txt > $OUT/speed-runs-$i.txt
  grep "CUDA graph recorded" /tmp/speed-log-$i.txt | sed 's/\x1b\[[0-9;]*m//g' > $OUT/graphs-$i.txt
  tail -29 $OUT/speed-$i.txt | grep " all "; tail -1 $OUT/graphs-$i.txt
done
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 10 --logits greedy"
for cfg in "256:" "1024:" "1024-s16:VERITY_CUDA_ATT_SPLIT=16" "1024-s32:VERITY_CUDA_ATT_SPLIT=32" "256-s16:VERITY_CUDA_ATT_SPLIT=16" "256-s5:VERITY_CUDA_ATT_SPLIT=5"; do
  name=${cfg%%:*}; envs=${cfg#*:}; ctx=${name%%-*}
  echo "== $name" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R --context $ctx 2>&1 | tail -6 >> $OUT/ab.txt
done
cat $OUT/ab.txt; echo "elapsed $SECONDS s"
