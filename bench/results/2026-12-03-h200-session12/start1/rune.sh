#!/bin/bash
# Session 12, start 1, call E: the landed build's rowcost at three contexts (two rounds) and every route's speed
# (two runs), with no build beside it.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export VERITY_CACHE_DIR=/tmp/vc
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
test -f $M || { echo "no model: fresh machine"; exit 3; }
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
mkdir -p $OUT/r
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do for ctx in 16 256 1024; do
  echo "== $ctx $i" >> $OUT/ab.txt; timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done; done
echo "rowcost $SECONDS s"
for i in 1 2; do
  timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$i.json > $OUT/r/speed-$i.txt 2> /dev/null
  echo "== speed $i" >> $OUT/speed.txt; tail -29 $OUT/r/speed-$i.txt >> $OUT/speed.txt
done
grep -E "==| all " $OUT/speed.txt; cat $OUT/ab.txt; echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
