#!/bin/bash
# Session 13, start 1, call C: the commit's build (x read once where a norm is fused; more registers in the
# narrow kernels) with 24 (default), 20 and 16 warps per narrow CTA of 4+ rows (VERITY_CUDA_NARROW_WARPS_ROWS;
# 80 / 96 / 122 registers, 308 / 44 / 0 bytes of spill loads). Rowexact under each, rowcost (3 rounds at ctx
# 256, 2 at 16 and 1024), speed one run each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && chmod +x /tmp/stage/verity-cuda
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
$V fetch smollm2-135m-mtp 2>&1 | tail -1
CFGS="w24 w20 w16"
for c in $CFGS; do
  VERITY_CUDA_NARROW_WARPS_ROWS=${c#w} $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done; wait
echo "warm $SECONDS s"
for c in $CFGS; do
  echo "== rowexact $c: $(VERITY_CUDA_NARROW_WARPS_ROWS=${c#w} timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"
done
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2 3; do for ctx in 256 16 1024; do [ $i = 3 ] && [ $ctx != 256 ] && continue; for c in $CFGS; do
  echo "== $ctx $c $i" >> $OUT/ab.txt; VERITY_CUDA_NARROW_WARPS_ROWS=${c#w} timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$c-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done; done; done
echo "rowcost $SECONDS s"
for c in $CFGS; do
  VERITY_CUDA_NARROW_WARPS_ROWS=${c#w} timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$c.json > $OUT/r/speed-$c.txt 2> /dev/null
  echo "== speed $c" >> $OUT/speed.txt; tail -29 $OUT/r/speed-$c.txt >> $OUT/speed.txt
done
grep -E "==| all " $OUT/speed.txt
python3 - $OUT/ab.txt <<'PY'
import sys,re,collections
cur=None; t=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith("=="): cur=tuple(l.split()[1:3]); continue
    m=re.match(r"\s+(\d+)\s+([\d.]+)",l)
    if m and cur: t[cur+(int(m.group(1)),)].append(m.group(2))
for ctx in ["16","256","1024"]:
    for c in ["w24","w20","w16"]:
        print(ctx, c.ljust(5), "  ".join("W%d %s"%(w,"/".join(t[(ctx,c,w)])) for w in [1,2,4,8,16]))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
