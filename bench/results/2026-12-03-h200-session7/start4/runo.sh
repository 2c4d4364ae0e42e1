#!/bin/bash
# Session 7, start 4 (branch cuda-s7b, the merge candidate): x quantized with four lanes per block (two where
# four would take more than one item per thread) for every launch; VERITY_CUDA_STAGE_LANES=8 = the previous
# eight-lane staging. GPU tests, rowexact, rowcost greedy A/B (2 rounds), speed of every route.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/o
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
for i in 1 2; do
for cfg in "rule:" "eight:VERITY_CUDA_STAGE_LANES=8"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== greedy $name $i" >> $OUT/ab.txt; timeout 40 env $envs $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy --json $OUT/rowcost-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
echo "== all rule" >> $OUT/ab.txt; timeout 40 $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits all 2>&1 | tail -6 >> $OUT/ab.txt
echo "== greedy rule context 1024" >> $OUT/ab.txt; timeout 40 $V --device cuda bench rowcost --model $M --context 1024 --widths 1,8 --repeat 9 --logits greedy 2>&1 | tail -3 >> $OUT/ab.txt
cat $OUT/ab.txt
echo "== speed"; timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 --json $OUT/speed.json 2>&1 | tail -29 > $OUT/speed.txt; cat $OUT/speed.txt
