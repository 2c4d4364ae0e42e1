#!/bin/bash
# Session 8, start 4, call C (branch s8b: narrow CTA warps by env, NVRTC program named after its source).
# rowcost A/B of 16 / 20 / 24 warps (2 rounds, interleaved), then tests and rowexact with the best, AR speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/w
mkdir -p /tmp/vc/models/smollm2-135m
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for w in 16 20 24; do
  echo "== warps $w round $i" >> $OUT/ab.txt; timeout 40 env VERITY_CUDA_NARROW_WARPS=$w $V --device cuda $R 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
# The best W=1 median over both rounds decides which warps the tests, rowexact and speed run with.
best=$(python3 - $OUT/ab.txt <<'PY'
import sys, re
cur=None; w1={}
for l in open(sys.argv[1]):
    m=re.match(r"== warps (\d+)", l)
    if m: cur=int(m.group(1)); continue
    p=l.split()
    if cur and len(p)==3 and p[0]=="1": w1.setdefault(cur,[]).append(float(p[1]))
print(min(w1, key=lambda w: (sum(w1[w])/len(w1[w]), w)))
PY
)
echo "best: $best"
for w in $(echo $best | grep -v "^16$"); do
  echo "== tests warps $w"; VERITY_CUDA_NARROW_WARPS=$w timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/tests-$w.txt; tail -1 $OUT/tests-$w.txt
  echo "== rowexact warps $w: $(VERITY_CUDA_NARROW_WARPS=$w timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/rowexact-$w.txt | grep -c 'bitwise equal')"
done
for i in 1 2; do
for w in $(echo 16 $best | tr ' ' '\n' | sort -un); do
  echo "== speed ar warps $w round $i" >> $OUT/speed.txt
  VERITY_CUDA_NARROW_WARPS=$w timeout 60 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar --prompts $D/prompts.jsonl --max-tokens 128 --repeat 2 2>&1 | grep "^ar " >> $OUT/speed.txt
done
done
cat $OUT/speed.txt
