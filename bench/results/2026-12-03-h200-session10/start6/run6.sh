#!/bin/bash
# Session 10, start 6: the review commit c267737 (attention's chunk count computed once; engine sessions without a
# lock): GPU tests, rowexact, rowcost at contexts 16/256/1024, every route's speed twice.
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
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "== tests"; timeout 100 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"
for ctx in 16 256 1024; do
  echo "== $ctx" >> $OUT/ab.txt; timeout 60 $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy --context $ctx --json $OUT/r/rc-$ctx.json 2>&1 | tail -6 >> $OUT/ab.txt
done
for i in 1 2; do
  timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$i.json > $OUT/r/speed-$i.txt 2> /dev/null
  echo "== speed $i" >> $OUT/speed.txt; tail -29 $OUT/r/speed-$i.txt >> $OUT/speed.txt
done
grep -E "==| all " $OUT/speed.txt; cat $OUT/ab.txt; echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
