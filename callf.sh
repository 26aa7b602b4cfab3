set -u
export CUTE_DSL_LINEINFO=1
NCU=/usr/local/cuda/bin/ncu
timeout -k 10 240 bash .dev/enter.sh $NCU --clock-control none --profile-from-start off --launch-count 1 --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight --import-source yes -o $OUT/replay_r4 python3 scripts/profile_kda.py --kernel replay --ring 4 --heads 96 --requests 32 > $OUT/ncu.log 2>&1
echo "ncu rc $?"; tail -5 $OUT/ncu.log
for src in sass cuda cuda,sass; do
timeout 60 bash .dev/enter.sh $NCU --import $OUT/replay_r4.ncu-rep --page source --csv --print-source $src > "$OUT/src_${src/,/_}.csv" 2> "$OUT/src_${src/,/_}.err"; echo "$src rc $? $(wc -l < "$OUT/src_${src/,/_}.csv")"; head -c 400 "$OUT/src_${src/,/_}.csv"; echo; tail -2 "$OUT/src_${src/,/_}.err"
done
timeout 60 bash .dev/enter.sh $NCU --import $OUT/replay_r4.ncu-rep --page details --csv > $OUT/details.csv 2>&1; echo "details $?"
grep -E "Duration|Issued Warp|Warp Cycles Per Issued|Executed Instructions\"" $OUT/details.csv | head
