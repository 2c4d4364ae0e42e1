#!/bin/bash
# Session 14, start 6 (second call; the first failed at load: attention's padded shared memory exceeded its
# limit): wide-schedule CTAs (the output layer) of 16 warps instead of 8
# (VERITY_CUDA_WIDE_WARPS: at W=8 its staging becomes one pass), and attention limited to 1 or 2 blocks per SM
# by padded shared memory (VERITY_CUDA_ATT_PER_SM). Tests, rowexact; rowcost ctx 256 W1/4/7/8/16 (4 rounds); speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s14f
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
cp $D/prompts.jsonl /tmp/stage/
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
mkdir -p /work && ln -sfn $PWD /work/main
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda; P=/tmp/stage/prompts.jsonl
$V fetch smollm2-135m-mtp 2>&1 | tail -1
env_of() { case $1 in
  new) echo "X=0";;
  w16) echo "VERITY_CUDA_WIDE_WARPS=16";;
  w12) echo "VERITY_CUDA_WIDE_WARPS=12";;
  att1) echo "VERITY_CUDA_ATT_PER_SM=1";;
  att2) echo "VERITY_CUDA_ATT_PER_SM=2";;
esac; }
CFGS="new w16 att1 att2"
for c in new w16; do env $(env_of $c) $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1; done
echo "warm $SECONDS s"
for c in new w16; do echo "== tests $c"; env $(env_of $c) timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests-$c.txt; tail -1 $OUT/r/tests-$c.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests-$c.txt | head -5; done
for c in $CFGS; do echo "== rowexact $c: $(env $(env_of $c) timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"; done
R="bench rowcost --model $M --widths 1,4,7,8,16 --repeat 15 --logits greedy --context 256"
for i in 1 2 3 4; do for c in $CFGS; do
  env $(env_of $c) timeout 60 $V --device cuda $R --json $OUT/r/rc-256-$c-$i.json > /dev/null 2>&1
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
for c in new w16; do
  env $(env_of $c) timeout 100 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts $P --max-tokens 128 --repeat 3 --json $OUT/r/sp-$c.json > $OUT/r/sp-$c.txt 2> /dev/null
  echo "speed $c: $(grep -E ' all ' $OUT/r/sp-$c.txt | awk '{print $1, $4, $5}' | tr '\n' ' ')"
done
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
