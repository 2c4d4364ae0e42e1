#!/bin/bash
# Session 13, start 6, call C: attention's variant at W=8 (ctx 256, the commit's kernels): the rule (early-load
# variant, 3 heads per block) vs the plain variant at every width (VERITY_CUDA_ATT_AHEAD=0) vs plain with a
# block per head (+ VERITY_CUDA_ATT_HEADS=1) vs the early-load variant only up to 1 block per SM
# (VERITY_CUDA_ATT_AHEAD_PER_SM=1). Rowcost W1/2/4/8, 4 interleaved rounds; rowexact under each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13h
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && chmod +x /tmp/stage/verity-cuda
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
env_of() { case $1 in rule) echo "X=0";; plain) echo "VERITY_CUDA_ATT_AHEAD=0";; plain1) echo "VERITY_CUDA_ATT_AHEAD=0 VERITY_CUDA_ATT_HEADS=1";; ahead1) echo "VERITY_CUDA_ATT_AHEAD_PER_SM=1";; esac; }
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "warm $SECONDS s"
CFGS="rule plain plain1 ahead1"
for c in $CFGS; do echo "== rowexact $c: $(env $(env_of $c) timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | grep -c 'bitwise equal')"; done
R="bench rowcost --model $M --widths 1,2,4,8 --repeat 15 --logits greedy --context 256"
for i in 1 2 3 4; do for c in $CFGS; do
  echo "== 256 $c $i" >> $OUT/ab.txt; env $(env_of $c) timeout 60 $V --device cuda $R --json $OUT/r/rc-256-$c-$i.json 2>&1 | tail -5 >> $OUT/ab.txt
done; done
python3 - $OUT/r <<'PY'
import sys,json,glob,collections
t=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/rc-*.json')):
    c=f.split('/')[-1].split('-')[2]
    d={x['w']:x['median_ms'] for x in json.load(open(f))['widths']}
    t[c].append("%.3f/%.3f/%.3f/%.3f=%.3f"%(d[1],d[2],d[4],d[8],d[8]/d[1]))
for c,v in t.items(): print(c.ljust(7), "  ".join(v))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
