"""What a new process pays before its first autofuse decision: importing, the environment fingerprint
(hardware, software and every op's code digest) and the search for a policy, each timed in fresh
interpreters, first with an empty user cache (the code digests parsed from the sources), then with
the cache the first run left (the digests read back). Medians over `--runs` interpreters each.

    python3 scripts/startup_cost.py --runs 5 --out startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch, triton
t1 = time.perf_counter()
import autofuse
from autofuse.dispatch.policy_files import find_policy
from autofuse.core import settings
from autofuse.measure import environment
t2 = time.perf_counter()
kind = "cuda" if torch.cuda.is_available() else "cpu"
fp = environment.fingerprint(kind)
t3 = time.perf_counter()
path = find_policy(fp, settings.mode(kind))
t4 = time.perf_counter()
environment.topology_matrix(), environment.gpu_uuids()  # the fingerprint's nvidia-smi calls, again
t5 = time.perf_counter()
environment.op_digests()  # in this process's memory by now
t6 = time.perf_counter()
print(json.dumps({"torch_triton_s": t1 - t0, "autofuse_s": t2 - t1, "fingerprint_s": t3 - t2,
                  "find_policy_s": t4 - t3, "nvidia_smi_s": t5 - t4, "digests_again_s": t6 - t5,
                  "policy": str(path), "device": fp["gpu_name"], "count": fp["gpu_count"]}))
"""


def _run(cache: str) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            rows["cold"].append(_run(cache))  # an empty cache: every source file parsed
            rows["warm"].append(_run(cache))  # what the first process left
    keys = ("torch_triton_s", "autofuse_s", "fingerprint_s", "find_policy_s", "nvidia_smi_s")
    result = {"device": rows["cold"][0]["device"], "count": rows["cold"][0]["count"], "runs": args.runs,
              "median": {c: {k: statistics.median(r[k] for r in rs) for k in keys} for c, rs in rows.items()},
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['device']} x{result['count']}, medians of {args.runs} fresh interpreters (s):")
    print(f"{'cache':<6}" + "".join(f"{k[:-2]:>15}" for k in keys))
    for c in ("cold", "warm"):
        print(f"{c:<6}" + "".join(f"{result['median'][c][k]:>15.3f}" for k in keys))


if __name__ == "__main__":
    main()
