#!/usr/bin/env bash
# Round 13 call 4 (2 GPUs): gemm_ar re-tuned again (the misaligned-out fix changed its digest), merged into
# round 12's shipped database, fitted.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
export TUNE_OPS=gemm_ar TUNE_MINUTES=1.5
BASE_DB=gpu_in/base-r12.db TAIL=6 bash scripts/gpu_ship.sh 2 0,1 tune,merge,fit,eval 2>&1 | grep -v "^\s*$"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1
timeout 60 python3 -m autofuse show --db /tmp/ship-w2/merged.db --mode graph > /tmp/ship-w2/show-graph.txt 2>&1
tar czf $OUT/ship-w2.tgz -C /tmp/ship-w2 --exclude=cache --exclude=data .
echo "=== done ($(date -u +%T))"
