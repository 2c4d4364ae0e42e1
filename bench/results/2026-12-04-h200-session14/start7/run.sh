#!/bin/bash
# Session 14, start 7: the session's last commit (9b3a5ee) — o and down split in two row groups at W=7-8,
# wide-schedule CTAs of 16 warps — vs the same binary with 8-warp wide CTAs (VERITY_CUDA_WIDE_WARPS=8). Tests,
# rowexact under both, rowcost ctx 256 W1/2/4/8/16 (6 interleaved rounds), ctx 16 and 1024 (1 round); speed of
# every route (2 runs).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s14g
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
env_of() { case $1 in new) echo "X=0";; base) echo "VERITY_CUDA_WIDE_WARPS=8";; esac; }
CFGS="new base"
for c in $CFGS; do env $(env_of $c) $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1; done
echo "warm $SECONDS s"
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests.txt | head -5
for c in $CFGS; do echo "== rowexact $c: $(env $(env_of $c) timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"; done
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2 3 4 5 6; do for c in $CFGS; do
  env $(env_of $c) timeout 60 $V --device cuda $R --context 256 --json $OUT/r/rc-256-$c-$i.json > /dev/null 2>&1
done; done
for i in 1; do for ctx in 16 1024; do for c in $CFGS; do
  env $(env_of $c) timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rx-$ctx-$c-$i.json > /dev/null 2>&1
done; done; done
python3 - $OUT/r <<'PY' | tee $OUT/ab.txt
import sys,json,glob,collections
t=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/r[cx]-*.json')):
    p=f.split('/')[-1][:-5].split('-'); c=p[1]+' '+p[2]
    d={x['w']:x['median_ms'] for x in json.load(open(f))['widths']}
    t[c].append("/".join("%.3f"%d[w] for w in sorted(d))+"=%.3f"%(d[8]/d[1]))
for c,v in t.items(): print(c.ljust(14), "  ".join(v))
PY
for i in 1 2; do
  timeout 150 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp,copy,draft_model --prompts $P \
    --max-tokens 128 --repeat 3 --json $OUT/r/speed-$i.json > $OUT/r/speed-$i.txt 2> /dev/null
  grep -E " all " $OUT/r/speed-$i.txt
done
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
