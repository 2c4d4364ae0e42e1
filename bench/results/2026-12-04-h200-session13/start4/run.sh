#!/bin/bash
# Session 13, start 4, call C: the output layer (wide schedule) at W=8 — ncu: 23.4 us at W=1, 31.7 at W=8,
# x staged in three passes (norm_scales, then two-lane quantization in two) by each of 384 CTAs in 1.45 waves.
# new = one lane per block where two would take two passes (one pass, norm from its own loads) + a grid of at
# most the CTAs the SMs hold (x staged once per CTA); l1only = VERITY_CUDA_WIDE_RESIDENT=0; resonly =
# -DSTAGE_NO_L1; old = both off. Tests, rowexact under each, rowcost (3 rounds ctx 256, 1 at 16 and 1024),
# speed new / old one run each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13e
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
declare -A NV=([new]="" [l1only]="" [resonly]="-DSTAGE_NO_L1" [old]="-DSTAGE_NO_L1")
declare -A RES=([new]=1 [l1only]=0 [resonly]=1 [old]=0)
CFGS="new l1only resonly old"
for c in new old; do
  VERITY_CUDA_NVRTC="${NV[$c]}" $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done; wait
echo "warm $SECONDS s"
echo "== tests new"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests-new.txt; tail -1 $OUT/r/tests-new.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests-new.txt | head -5
for c in $CFGS; do
  echo "== rowexact $c: $(VERITY_CUDA_WIDE_RESIDENT=${RES[$c]} VERITY_CUDA_NVRTC="${NV[$c]}" timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"
done
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2 3; do for ctx in 256 16 1024; do [ $i -gt 1 ] && [ $ctx != 256 ] && continue; for c in $CFGS; do
  echo "== $ctx $c $i" >> $OUT/ab.txt; VERITY_CUDA_WIDE_RESIDENT=${RES[$c]} VERITY_CUDA_NVRTC="${NV[$c]}" timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$c-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done; done; done
echo "rowcost $SECONDS s"
python3 - $OUT/ab.txt <<'PY'
import sys,re,collections
cur=None; t=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith("=="): cur=tuple(l.split()[1:3]); continue
    m=re.match(r"\s+(\d+)\s+([\d.]+)\s+([\d.]+)",l)
    if m and cur: t[cur+(int(m.group(1)),)].append(m.group(2)); t[cur+("r",int(m.group(1)))].append(m.group(3))
for ctx in ["16","256","1024"]:
    for c in "new l1only resonly old".split():
        print(ctx, c.ljust(7), "  ".join("W%d %s"%(w,"/".join(t[(ctx,c,w)])) for w in [1,2,4,8,16]), " r8", "/".join(t[(ctx,c,"r",8)]))
PY
for c in new old; do
  VERITY_CUDA_WIDE_RESIDENT=${RES[$c]} VERITY_CUDA_NVRTC="${NV[$c]}" timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$c.json > $OUT/r/speed-$c.txt 2> /dev/null
  echo "== speed $c" >> $OUT/speed.txt; tail -29 $OUT/r/speed-$c.txt >> $OUT/speed.txt
done
grep -E "==| all " $OUT/speed.txt
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
