#!/bin/bash
# Session 14, start 3: attention blocks of a whole GQA group taking two rows each in crowded grids
# (VERITY_CUDA_ATT_ROW_PAIRS=0: not), and down's rows split in two groups where its staging would take
# two-lane items and each half one pass (VERITY_CUDA_SPLIT_STAGING=0: not). Tests, rowexact, rowcost, speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s14c
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
env_of() { case $1 in
  new) echo "X=0";;
  nopairs) echo "VERITY_CUDA_ATT_ROW_PAIRS=0";;
  base) echo "VERITY_CUDA_ATT_ROW_PAIRS=0 VERITY_CUDA_SPLIT_STAGING=0";;
esac; }
CFGS="new nopairs base"
$V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1
echo "warm $SECONDS s"
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests.txt | head -5
for c in $CFGS; do echo "== rowexact $c: $(env $(env_of $c) timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"; done
R="bench rowcost --model $M --widths 1,4,6,7,8,16 --repeat 15 --logits greedy --context 256"
for i in 1 2 3 4; do for c in $CFGS; do
  env $(env_of $c) timeout 60 $V --device cuda $R --json $OUT/r/rc-256-$c-$i.json > /dev/null 2>&1
done; done
for ctx in 16 1024; do for c in new base; do
  env $(env_of $c) timeout 60 $V --device cuda bench rowcost --model $M --widths 1,4,8,16 --repeat 15 --logits greedy --context $ctx --json $OUT/r/rx-$ctx-$c.json > /dev/null 2>&1
done; done
python3 - $OUT/r <<'PY' | tee $OUT/ab.txt
import sys,json,glob,collections
t=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/r[cx]-*.json')):
    p=f.split('/')[-1][:-5].split('-'); c=p[1]+' '+p[2]
    d={x['w']:x['median_ms'] for x in json.load(open(f))['widths']}
    t[c].append("/".join("%.3f"%d[w] for w in sorted(d))+"=%.3f"%(d[8]/d[1]))
for c,v in t.items(): print(c.ljust(14), "  ".join(v))
PY
timeout 150 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
  --max-tokens 128 --repeat 3 --json $OUT/r/speed.json > $OUT/r/speed.txt 2> /dev/null
grep -E " all " $OUT/r/speed.txt
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
