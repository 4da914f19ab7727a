# Call 1 (4x H200 kind): the 4-GPU table re-measured after the code change (every op's digest moved):
# every problem of the shipped tuning_db/h200x4.db, baselines and previous winners first, fitted, exported and
# evaluated on held-out problems (graph mode).
set -u
BASE_DB=tuning_db/h200x4.db TUNE_MINUTES=${TUNE_MINUTES:-4.5} bash scripts/gpu_ship.sh 4 0,1,2,3 retune,fit,export,eval
cp /tmp/ship-w4/retuned.db "$OUT/h200x4-retuned.db" 2>/dev/null
cp /tmp/ship-w4/policy-graph.json "$OUT/w4-policy-graph.json" 2>/dev/null
cp /tmp/ship-w4/policy-eager.json "$OUT/w4-policy-eager.json" 2>/dev/null
