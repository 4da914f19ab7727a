"""Mixed precision on CUDA ranks: a parallelized tiny Llama with float32 weights under
torch.autocast("cuda", bfloat16), logits, loss and every gradient against the whole model under the same
autocast, both forms; autofuse's own choice, then the variants named in argv[1] forced (AUTOFUSE_VARIANT).
Two ranks; with one GPU let them share it (nothing is timed):

    AUTOFUSE_RANKS_PER_GPU=2 AUTOFUSE_HEAP_SIZE=1G python3 scripts/autocast_gpu.py ag_gemm:push,gemm_rs:push_last,gemm_ar:one_shot
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch


def job(world) -> dict:
    import autofuse
    import harness
    import test_nn
    dev = world.device
    ref = test_nn.tiny_llama(world.size).to(dev).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4)).to(dev)

    def forward(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = m(input_ids=ids, labels=ids)
        return o.logits, o.loss

    want = harness.unsharded_run(copy.deepcopy(ref), forward)
    out = {}
    for sp in (False, True):
        model = autofuse.parallelize(copy.deepcopy(ref), world.group, sequence_parallel=sp)
        got = harness.against(model, forward, want)
        out[f"sp={sp}"] = {k: got[k] for k in ("logits", "loss", "worst grad", "grad keys")}
    return out


if __name__ == "__main__":
    from autofuse.comm.world import spawn
    warnings.simplefilter("ignore")
    for name, fused in (("default", ""), ("fused", sys.argv[1])):
        if fused:
            os.environ["AUTOFUSE_VARIANT"] = fused
        for r, res in enumerate(spawn(job, 2, device_kind="cuda", timeout_s=600)):
            print(name, r, res)
