#!/bin/bash
# Session 13, start 3, call C: attention at W=8 (the knockouts of start 2: attention 0.13 ms of W=1, 0.18 of
# W=8 at ctx 256). ncu per launch (graphs off, past the prefill) of the whole forward and of attention alone
# with more metrics, W=1 and W=8, ctx 256; rowcost with the attention knobs forced (heads per block 1 / 3,
# blocks per (row, head block) 3 / 5 / 8 / 10), 2 interleaved rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13d
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && chmod +x /tmp/stage/verity-cuda
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "warm $SECONDS s"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
RC="bench rowcost --model $M --repeat 40 --context 256 --logits greedy"
for w in 1 8; do
  VERITY_CUDA_GRAPHS=0 timeout 150 $NCU --cache-control none --csv --page raw --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
    --launch-skip 4500 --launch-count 170 $V --device cuda $RC --widths $w > $OUT/r/ncu-w$w.csv 2> $OUT/r/ncu-w$w.err
  VERITY_CUDA_GRAPHS=0 timeout 150 $NCU --cache-control none --csv --page raw --kernel-name regex:attention \
    --metrics gpu__time_duration.sum,sm__cycles_active.avg,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,smsp__average_warp_latency_per_inst_issued.ratio \
    --launch-skip 800 --launch-count 60 $V --device cuda $RC --widths $w > $OUT/r/ncu-att-w$w.csv 2> $OUT/r/ncu-att-w$w.err
  echo "ncu w$w $SECONDS s"
done
R="bench rowcost --model $M --widths 1,2,4,8 --repeat 15 --logits greedy --context 256"
CFGS="base h1 h3 s3 s5 s8 s10"
env_of() { case $1 in base) echo "X=0";; h1) echo "VERITY_CUDA_ATT_HEADS=1";; h3) echo "VERITY_CUDA_ATT_HEADS=3";; s*) echo "VERITY_CUDA_ATT_SPLIT=${1#s}";; esac; }
for i in 1 2; do for c in $CFGS; do
  echo "== 256 $c $i" >> $OUT/ab.txt; env $(env_of $c) timeout 60 $V --device cuda $R --json $OUT/r/rc-256-$c-$i.json 2>&1 | tail -5 >> $OUT/ab.txt
done; done
python3 - $OUT/ab.txt <<'PY'
import sys,re,collections
cur=None; t=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith("=="): cur=tuple(l.split()[1:3]); continue
    m=re.match(r"\s+(\d+)\s+([\d.]+)",l)
    if m and cur: t[cur+(int(m.group(1)),)].append(m.group(2))
for c in "base h1 h3 s3 s5 s8 s10".split():
    print("256", c.ljust(5), "  ".join("W%d %s"%(w,"/".join(t[("256",c,w)])) for w in [1,2,4,8]))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
