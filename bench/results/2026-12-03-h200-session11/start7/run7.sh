#!/bin/bash
# Session 11, start 7: the session's last commit (2fb83b6) on the GPU: tests, rowexact, rowcost at three contexts
# (one round), every route's speed (two runs).
#
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s11
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
for envs in ""; do
  env $envs $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done; wait
echo "warm $SECONDS s"
echo "== tests"; timeout 100 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt
for h in rule; do
  envs=""
  echo "== rowexact $h: $(timeout 60 env $envs $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$h.txt | grep -c 'bitwise equal')"
done
echo "tests $SECONDS s"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1; do
for ctx in 16 256 1024; do
for cfg in "rule:"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  echo "== $ctx $name $i" >> $OUT/ab.txt; timeout 60 env $envs $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
done
echo "rowcost $SECONDS s"
for i in 1 2; do
for cfg in "rule:"; do
  name=${cfg%%:*}; envs=${cfg#*:}
  env $envs VERITY_LOG=verity=debug timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$name-$i.json > $OUT/r/speed-$name-$i.txt 2> /tmp/log.txt
  grep "CUDA graph recorded" /tmp/log.txt | sed 's/\x1b\[[0-9;]*m//g' | tail -1 > $OUT/r/graphs-$name-$i.txt
  echo "== speed $name $i: $(cat $OUT/r/graphs-$name-$i.txt | cut -c60-)" >> $OUT/speed.txt; tail -29 $OUT/r/speed-$name-$i.txt >> $OUT/speed.txt
done
done
grep -E "==| all " $OUT/speed.txt; cat $OUT/ab.txt; echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
