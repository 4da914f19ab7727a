#!/usr/bin/env bash
# Round 21 call 6 (1x H200, the only kind lent by then): the tuner's sampled configs asked ahead and compiled by the
# compile-ahead workers, on a real GPU (one rank: a functional check of the path, no speed claim): a short tune of two
# gemm_rs problems at world 1, then the study's trials: none left RUNNING, those asked ahead measured or failed.
set -u
OUT=${OUT:-/tmp/out}; export OUT
export PYTHONUNBUFFERED=1 COLUMNS=140 PYTHONWARNINGS=ignore::FutureWarning
OUT=/tmp/install-out bash scripts/gpu_session.sh --name install sh:true > /dev/null 2>&1 || { echo "offline install failed"; exit 1; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/xdg-cache
nvidia-smi --query-gpu=index,name --format=csv > "$OUT/call6-machine.txt" 2>&1
timeout -k 10 150 python3 -m autofuse tune --world 1 --op gemm_rs --limit 2 --time-limit 1.2 --db "$OUT/call6-w1.db" \
  > "$OUT/call6-tune.log" 2>&1; echo "tune rc=$?"
tail -n 4 "$OUT/call6-tune.log"
python3 - <<'PY'
import os, optuna
from autofuse.tuning.storage import default_storage, open_storage
storage = open_storage(default_storage(os.environ["OUT"] + "/call6-w1.db"))
for s in optuna.get_all_study_summaries(storage):
    ts = optuna.load_study(study_name=s.study_name, storage=storage).get_trials(deepcopy=False)
    ahead = [t for t in ts if t.user_attrs.get("asked_ahead")]
    print(s.study_name[:40], "trials", len(ts), "running", sum(t.state.name == "RUNNING" for t in ts),
          "asked ahead", len(ahead), "of them measured", sum(bool(t.user_attrs.get("measured")) for t in ahead),
          "released", sum("abandoned" in t.user_attrs for t in ahead))
PY
