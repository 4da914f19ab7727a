# Sourced by the call scripts: the machine's kind and its shipped database.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONWARNINGS=ignore::FutureWarning
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
case "$GPU" in
  *H100*) KIND=h100x2; BASE=tuning_db/h100x2.db ;;
  *H200*) KIND=h200x2; BASE=tuning_db/h200x2.db ;;
  *) KIND=unknown; BASE= ;;
esac
echo "gpu: $GPU x$N kind $KIND base $BASE ($(date -u +%H:%M:%S))"
