# Call 2 (same machine, GPUs 0,1): the 2-GPU table re-measured the same way, then the layer bench at TP=2.
set -u
BASE_DB=tuning_db/h200x2.db TUNE_MINUTES=${TUNE_MINUTES:-4.5} bash scripts/gpu_ship.sh 2 0,1 retune,fit,export,eval,layer
cp /tmp/ship-w2/retuned.db "$OUT/h200x2-retuned.db" 2>/dev/null
cp /tmp/ship-w2/policy-graph.json "$OUT/w2-policy-graph.json" 2>/dev/null
cp /tmp/ship-w2/policy-eager.json "$OUT/w2-policy-eager.json" 2>/dev/null
