#!/bin/bash
# Session 10, start 1, call D: every route's speed with the graph store's counts (LRU eviction), context 1024
# rowcost for the attention variants.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -x /tmp/stage/verity-cuda || { echo "fresh machine"; exit 3; }
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf; P=/tmp/stage/prompts.jsonl
mkdir -p /work && ln -sfn $PWD /work/main
S=$SECONDS
VERITY_LOG=verity=debug timeout 300 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
  --max-tokens 128 --repeat 3 --json $OUT/speed.json > $OUT/speed.txt 2> $OUT/speed-log.txt
tail -29 $OUT/speed.txt; grep "CUDA graph recorded" $OUT/speed-log.txt | tail -3; echo "speed in $((SECONDS - S)) s"
EXTRA=${EXTRA:-}
for ctx in 16 1024; do
for cfg in "full:" "smemall:VERITY_CUDA_NVRTC=-DATT_SMEM VERITY_CUDA_ATT_AHEAD_PER_SM=64"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== ctx $ctx $name" >> $OUT/ctx.txt; timeout 60 env $envs $V --device cuda bench rowcost --model $M --context $ctx --widths 1,2,4,8,16 --repeat 10 --logits greedy 2>&1 | tail -6 >> $OUT/ctx.txt
done
done
cat $OUT/ctx.txt; echo "elapsed $SECONDS s"
