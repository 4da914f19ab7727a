#!/usr/bin/env bash
# Round 14 call 2 (2 GPUs): the hybrids' one-pass row epilogues (kernels/moe_rows.py): GPU tests (graph replay),
# bench moe hybrid vs bsp (graph), and the eager host profile of Mixtral T=4096.
source gpu_in/common.sh
export PYTHONUNBUFFERED=1 COLUMNS=150
OUT_SAVE=$OUT
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "install failed"; exit 1; }
OUT=$OUT_SAVE
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_ONLINE_DB=/tmp/online.db
echo "=== moe gpu tests ($(date -u +%T))"
AUTOFUSE_TEST_WORLD=2 timeout 200 python3 -m pytest -q -m gpu tests/test_moe_hybrid.py > $OUT/moe-tests.log 2>&1
echo "rc=$?"; tail -3 $OUT/moe-tests.log
echo "=== bench moe ($(date -u +%T))"
timeout 300 python3 -m autofuse bench moe --world 2 --mode graph --tokens 1,64,1024,4096 --variants bsp,hybrid --reps 10 \
  --out $OUT/bench-moe.json --force > $OUT/bench-moe.log 2>&1
echo "rc=$?"; grep -v "^\s*$" $OUT/bench-moe.log | head -40
echo "=== profile ($(date -u +%T))"
timeout 150 python3 scripts/moe_a2a_gpu.py --world 2 --mode eager --models mixtral --tokens 4096 --profile mixtral:4096 > $OUT/profile.log 2>&1
echo "rc=$?"; grep -v '^{' $OUT/profile.log | cut -c1-60,100-200 | tail -45
echo "=== done ($(date -u +%T))"
