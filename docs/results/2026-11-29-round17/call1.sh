set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/call1-machine.txt
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null && touch /tmp/site/.installed
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 scripts/launch_cost_gpu.py --out $OUT/call1-launch-cost.json > $OUT/call1-launch-cost.log 2>&1
SH_LIMIT=225 bash scripts/gpu_core_sweep.sh > $OUT/call1-core.log 2>&1
cat $OUT/call1-machine.txt; cat $OUT/call1-launch-cost.log | tail -8; tail -30 $OUT/call1-core.log
