#!/bin/bash
# Session 14, start 8: the final commit (4c0a8e8, the row-group rule as a pure function) on the GPU: tests,
# rowexact, rowcost ctx 256 (2 rounds), speed of every route (one run).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s14h
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests.txt | head -5
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"
for i in 1 2; do
  timeout 60 $V --device cuda bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy --context 256 --json $OUT/r/rc-256-$i.json > /dev/null 2>&1
  python3 -c "import json,sys; d={x['w']:x['median_ms'] for x in json.load(open(sys.argv[1]))['widths']}; print('256', '/'.join('%.3f'%d[w] for w in sorted(d)), '= %.3f'%(d[8]/d[1]))" $OUT/r/rc-256-$i.json | tee -a $OUT/ab.txt
done
timeout 150 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
  --max-tokens 128 --repeat 3 --json $OUT/r/speed.json > $OUT/r/speed.txt 2> /dev/null
grep -E " all " $OUT/r/speed.txt | tee -a $OUT/ab.txt
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
