#!/bin/bash
# Session 9, start 6, call D: the landed kernels (the s9d build's default, = main at fccf772: no -D options),
# on the same machine right after the cluster A/B: rowcost and every route's speed.
D=.device/s9d; M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf; V=/tmp/stage/v9d
$V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy | tail -6 > $OUT/rowcost.txt
$V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $D/prompts.jsonl \
  --max-tokens 128 --repeat 3 --json $OUT/speed.json | tail -29 > $OUT/speed.txt
