#!/bin/bash
# Session 13, start 5, call C: (1) greedy MTP drafts as one chain on the device (each step's token picked from
# the step before's argmax there; the host waits once per draft) vs step by step through the host
# (VERITY_MTP_CHAIN=0), same binary, 3 interleaved speed rounds of ar,mtp; (2) attention's value sums reading
# the softmax weights four slots at a time (default) vs scalar reads (-DATT_SCALAR_P): rowcost 3 rounds at ctx
# 256, 1 at 1024. GPU tests (13, with the chained-draft test), rowexact under both kernels.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s13g
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
for o in "" "-DATT_SCALAR_P"; do
  VERITY_CUDA_NVRTC="$o" $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done; wait
echo "warm $SECONDS s"
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result|panicked|differs" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt; grep -E "FAILED|panicked|differs" $OUT/r/tests.txt | head -5
for o in "" "-DATT_SCALAR_P"; do
  echo "== rowexact '$o': $(VERITY_CUDA_NVRTC="$o" timeout 60 $V --device cuda bench rowexact --model $M --prompts $P 2>&1 | tee $OUT/r/rowexact$o.txt | grep -c 'bitwise equal')"
done
for i in 1 2 3; do
  for c in chain step; do
    ch=1; [ $c = step ] && ch=0
    VERITY_MTP_CHAIN=$ch timeout 200 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar,mtp --prompts $P \
      --max-tokens 128 --repeat 3 --json $OUT/r/speed-$c-$i.json > $OUT/r/speed-$c-$i.txt 2> /dev/null
    echo "== speed $c $i: $(grep -E '^(ar|mtp) +all' $OUT/r/speed-$c-$i.txt | tr -s ' ' | tr '\n' ';')" | tee -a $OUT/speed.txt
  done
done
echo "speed $SECONDS s"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2 3; do for ctx in 256 1024; do [ $i -gt 1 ] && [ $ctx != 256 ] && continue; for c in f4 scalar; do
  o=""; [ $c = scalar ] && o="-DATT_SCALAR_P"
  echo "== $ctx $c $i" >> $OUT/ab.txt; VERITY_CUDA_NVRTC="$o" timeout 60 $V --device cuda $R --context $ctx --json $OUT/r/rc-$ctx-$c-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done; done; done
python3 - $OUT/ab.txt <<'PY'
import sys,re,collections
cur=None; t=collections.defaultdict(list)
for l in open(sys.argv[1]):
    if l.startswith("=="): cur=tuple(l.split()[1:3]); continue
    m=re.match(r"\s+(\d+)\s+([\d.]+)",l)
    if m and cur: t[cur+(int(m.group(1)),)].append(m.group(2))
for ctx in ["256","1024"]:
    for c in ["f4","scalar"]:
        print(ctx, c.ljust(6), "  ".join("W%d %s"%(w,"/".join(t[(ctx,c,w)])) for w in [1,2,4,8,16]))
PY
echo "elapsed $SECONDS s"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
