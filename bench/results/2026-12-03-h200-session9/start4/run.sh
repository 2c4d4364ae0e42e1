#!/bin/bash
# Session 9, start 4, call C: where a step's time goes. Knockouts (-DKO_STAGE: no staging of x; -DKO_CHAIN: no
# per-(column, row) chains; -DKO_ATT: no attention; -DLAUNCH_FLOOR) side by side with the full forward at
# W = 1..16; -DQ8_L4 (four lanes per block always); ncu stall samples per source line of the narrow projections
# at W=1 and W=8. Also: GPU tests and rowexact on this build (the knockout macros compiled out), AR speed.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
test -f /tmp/stage/p1 || { echo "fresh machine: stage again"; exit 3; }
D=.device/s9d
mkdir -p /tmp/vc/models/smollm2-135m $OUT/r
M=/tmp/vc/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/p0 /tmp/stage/p1 $D/p1t $D/p2 > $M
echo "$(cat $D/model.sha256)  $M" | sha256sum -c || exit 4
xz -dc $D/verity-cuda.xz > /tmp/stage/verity-cuda && xz -dc $D/cuda-test.xz > /tmp/stage/cuda-test && chmod +x /tmp/stage/verity-cuda /tmp/stage/cuda-test
export VERITY_CACHE_DIR=/tmp/vc
V=/tmp/stage/verity-cuda
mkdir -p /work && ln -sfn $PWD /work/main
$V fetch smollm2-135m-mtp 2>&1 | tail -1
for opt in "" "-DKO_STAGE" "-DKO_CHAIN" "-DKO_ATT" "-DLAUNCH_FLOOR" "-DQ8_L4" "-lineinfo"; do
  VERITY_CUDA_NVRTC="$opt" timeout 150 $V --device cuda bench rowcost --model $M --widths 1 --repeat 1 --logits greedy > /dev/null 2>&1 &
done
wait
ls /tmp/vc/cuda | wc -l
echo "== tests"; timeout 150 /tmp/stage/cuda-test --test-threads 1 2>&1 | grep -E "^test |test result" > $OUT/r/tests.txt; tail -1 $OUT/r/tests.txt
echo "== rowexact: $(timeout 60 $V --device cuda bench rowexact --model $M --prompts $D/prompts.jsonl 2>&1 | tee $OUT/r/rowexact.txt | grep -c 'bitwise equal')"
R="bench rowcost --model $M --widths 1,2,4,8,16 --repeat 15 --logits greedy"
for i in 1 2; do
for cfg in "full:" "ko_stage:-DKO_STAGE" "ko_chain:-DKO_CHAIN" "ko_att:-DKO_ATT" "floor:-DLAUNCH_FLOOR" "q8l4:-DQ8_L4"; do
  name=${cfg%%:*}; opt=${cfg#*:}
  echo "== $name $i" >> $OUT/ab.txt; VERITY_CUDA_NVRTC="$opt" timeout 60 $V --device cuda $R --json $OUT/r/rc-$name-$i.json 2>&1 | tail -6 >> $OUT/ab.txt
done
done
cat $OUT/ab.txt
N=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for w in 1 8; do
  VERITY_CUDA_NVRTC=-lineinfo VERITY_CUDA_GRAPHS=0 timeout 150 $N --cache-control none --kernel-name regex:qmatmuls_narrow --launch-skip 400 --launch-count 4 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy --import-source yes -o /tmp/ncu-w$w -f \
    $V --device cuda bench rowcost --model $M --context 16 --repeat 3 --widths $w --logits greedy > $OUT/r/ncu-run-w$w.txt 2>&1
  $N -i /tmp/ncu-w$w.ncu-rep --page details --csv > $OUT/r/ncu-details-w$w.csv 2>&1
  $N -i /tmp/ncu-w$w.ncu-rep --page source --csv --print-source cuda > $OUT/r/ncu-source-w$w.csv 2>&1
  python3 $D/topsrc.py $OUT/r/ncu-source-w$w.csv > $OUT/r/topsrc-w$w.txt 2>&1
  head -c 3000 $OUT/r/topsrc-w$w.txt
done
echo "== speed"; timeout 100 $V --device cuda bench speed --model smollm2-135m-mtp --routes ar --prompts $D/prompts.jsonl --max-tokens 128 --repeat 3 2>&1 | tail -8 > $OUT/r/speed.txt; cat $OUT/r/speed.txt
cd $OUT && tar cJf r.tar.xz r && rm -rf r && ls -la $OUT
