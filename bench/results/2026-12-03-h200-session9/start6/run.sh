#!/bin/bash
# Session 9, start 6, call C: attention's split blocks of a (row, head) as one thread-block cluster, combining
# their chunk records through distributed shared memory (vs VERITY_CUDA_ATT_CLUSTER=0: records in global
# memory, a fence and an atomic counter). GPU tests and rowexact on both paths, rowcost A/B at contexts 256, 16
# and 1024, speed of every route.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9f
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
timeout 150 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /tmp/first.txt 2>&1 || { echo "CLUSTER PATH FAILED"; head -20 /tmp/first.txt; cp /tmp/first.txt $OUT/first-fail.txt; }
head -3 /tmp/first.txt
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|error" | head -30 > $OUT/r/tests.txt; cat $OUT/r/tests.txt | tail -4
echo "== rowexact cluster: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"; tail -2 $OUT/r/rowexact.txt
echo "== rowexact global: $(VERITY_CUDA_ATT_CLUSTER=0 timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact-global.txt | grep -c 'bitwise equal')"
echo "== tests global: $(VERITY_CUDA_ATT_CLUSTER=0 timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E 'test result')"
for ctx in 256 16 1024; do
R="bench rowcost --model $M --context $ctx --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "cluster:" "global:VERITY_CUDA_ATT_CLUSTER=0"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== ctx $ctx $name $i" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R --json $OUT/r/rc-$ctx-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
done
cat $OUT/ab.txt
echo "== speed"; timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/r/speed.json 2>&1 | tail -29 > $OUT/r/speed.txt; cat $OUT/r/speed.txt
cd $OUT && tar cJf r.tar.xz r && rm -rf r && ls -la $OUT
