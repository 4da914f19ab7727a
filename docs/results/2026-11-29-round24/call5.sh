# Call 5 (2x H200): the round's code on the GPUs. The held-out evaluation with the shipped 2-GPU policy (first-use
# confirmation now also times the nearest tuned problem's winners), `bench train_layer` TP=2 70B and 8B (eager
# autofuse now runs a gated MLP's SwiGLU as one kernel each way), then the GPU tests of what changed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
bash scripts/gpu_ship.sh 2 0,1 shipped,eval,train
cp /tmp/ship-w2/eval-graph.json "$OUT/call5-eval.json"; cp /tmp/ship-w2/eval.log "$OUT/call5-eval.log"
cp /tmp/ship-w2/bench-train_layer.json "$OUT/call5-train.json"; cp /tmp/ship-w2/train.log "$OUT/call5-train.log"
cp /tmp/ship-w2/machine.txt "$OUT/call5-machine.txt"
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0,1 AUTOFUSE_TEST_WORLD=2
timeout -k 10 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_swiglu.py tests/test_nn.py -k "swiglu or gpu_llama" \
  > "$OUT/call5-gpu-tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/call5-gpu-tests.log"
python3 - "$OUT/call5-train.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    u = r["us"]
    print(r["model"], r["tokens"], {k: round(v) for k, v in u.items()},
          "eager/tp %.3f" % (u["torch-tp"] / u["autofuse"]), "compiled/async %.3f" % (u["torch-async-tp"] / u["autofuse-compiled"]),
          "ok", r["ok"])
PY
