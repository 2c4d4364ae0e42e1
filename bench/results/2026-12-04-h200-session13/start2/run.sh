#!/bin/bash
# Session 13, start 2, call C: where W=8's extra time goes now. Knockouts (KO_STAGE, KO_CHAIN, KO_ATT,
# LAUNCH_FLOOR; every shape admitted unchecked under one, so W-row launches run as they would) vs the build,
# rowcost W1/2/4/8 at ctx 256 (3 interleaved rounds) and 16 (1 round); then ncu per launch (graphs off) of
# one forward at W=1 and W=8, ctx 256.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13c
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && chmod +x /tmp/stage/verity-cuda
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
opt() { case $1 in base) echo "";; stage) echo "-DKO_STAGE";; chain) echo "-DKO_CHAIN";; att) echo "-DKO_ATT";; floor) echo "-DLAUNCH_FLOOR";; esac; }
CFGS="base stage chain att floor"
for c in $CFGS; do
  VERITY_CUDA_NVRTC="$(opt $c)" $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done; wait
echo "warm $SECONDS s"
echo "== rowexact base: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"
R="bench rowcost --model $M --widths 1,2,4,8 --repeat 15 --logits greedy"
for i in 1 2 3; do for ctx in 256 16; do [ $i -gt 1 ] && [ $ctx = 16 ] && continue; for c in $CFGS; do
  echo "== $ctx $c $i" >> $OUT/ab.txt; VERITY_CUDA_NVRTC="$(opt $c)" timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$c-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done; done; done
echo "rowcost $SECONDS s"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 150 $NCU --cache-control none --csv --page raw --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
    --launch-skip 1500 --launch-count 170 $V --device cuda bench rowcost --model $M --widths $w --repeat 15 --context 256 --logits greedy > $OUT/r/ncu-w$w.csv 2> $OUT/r/ncu-w$w.err
  echo "ncu w$w rc $? lines $(wc -l < $OUT/r/ncu-w$w.csv) $SECONDS s"
done
python3 - $OUT/ab.txt <<'PY'
import sys,re,collections
cur=None; t=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith("=="): cur=tuple(l.split()[1:3]); continue
    m=re.match(r"\s+(\d+)\s+([\d.]+)",l)
    if m and cur: t[cur+(int(m.group(1)),)].append(m.group(2))
for ctx in ["16","256"]:
    for c in ["base","stage","chain","att","floor"]:
        print(ctx, c.ljust(6), "  ".join("W%d %s"%(w,"/".join(t[(ctx,c,w)])) for w in [1,2,4,8]))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
