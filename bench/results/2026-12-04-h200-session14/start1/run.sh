#!/bin/bash
# Session 14, start 1: where W=8's extra time goes in attention (knockouts: first head's arithmetic only;
# no combine) and down's rows split in two groups where its staging would take two-lane items
# (VERITY_CUDA_SPLIT_STAGING, on by default in this binary). Rowcost ctx 256 W1/4/8, interleaved rounds.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s14a
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 $D/p0b /tmp/stage/p1 $D/p1b $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && chmod +x /tmp/stage/verity-cuda
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
env_of() { case $1 in
  split) echo "X=0";;
  base) echo "VERITY_CUDA_SPLIT_STAGING=0";;
  onehead) echo "VERITY_CUDA_SPLIT_STAGING=0 VERITY_CUDA_NVRTC=-DKO_ATT_ONEHEAD";;
  nocomb) echo "VERITY_CUDA_SPLIT_STAGING=0 VERITY_CUDA_NVRTC=-DKO_ATT_NOCOMBINE";;
  noatt) echo "VERITY_CUDA_SPLIT_STAGING=0 VERITY_CUDA_NVRTC=-DKO_ATT";;
esac; }
CFGS="split base onehead nocomb noatt"
for c in $CFGS; do env $(env_of $c) $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1; done
echo "warm $SECONDS s"
for c in split base; do echo "== rowexact $c: $(env $(env_of $c) timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact-$c.txt | grep -c 'bitwise equal')"; done
grep -i "verif\|admit\|one row" $OUT/r/rowexact-split.txt | head -5
R="bench rowcost --model $M --widths 1,4,8 --repeat 15 --logits greedy --context 256"
for i in 1 2 3; do for c in $CFGS; do
  echo "== 256 $c $i" >> $OUT/ab.txt; env $(env_of $c) timeout 60 $V --device cuda $R --json $OUT/r/rc-256-$c-$i.json 2>&1 | tail -4 >> $OUT/ab.txt
done; done
for ctx in 16 1024; do for c in split base; do
  env $(env_of $c) timeout 60 $V --device cuda bench rowcost --model $M --widths 1,4,8,16 --repeat 15 --logits greedy --context $ctx --json $OUT/r/rx-$ctx-$c.json > /dev/null 2>&1
done; done
python3 - $OUT/r <<'PY'
import sys,json,glob,collections
t=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/r[cx]-*.json')):
    p=f.split('/')[-1][:-5].split('-'); c=p[1]+' '+p[2]
    d={x['w']:x['median_ms'] for x in json.load(open(f))['widths']}
    t[c].append("/".join("%.3f"%d[w] for w in sorted(d))+"=%.3f"%(d[8]/d[1]))
for c,v in t.items(): print(c.ljust(14), "  ".join(v))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
