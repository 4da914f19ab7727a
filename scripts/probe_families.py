"""Which transformers model families `autofuse.parallelize` takes, and whether each is right.

For every family named (default: FAMILIES below), builds a tiny random model from transformers' own config
class (hidden 32, 2 layers, 4 heads, 2 KV heads, 4 experts top-2 where it has experts; every 1-D parameter
moved off its initial ones/zeros), parallelizes it on CPU ranks in both forms and compares logits, loss and
every gradient (gathered with `autofuse.nn.full_grads`) with the unsharded model in float64. Prints one line
per family: the worst relative differences per form, or the error `parallelize` raised (a refusal names what
it does not know how to split). Not a test: tests/test_nn.py and tests/test_moe_nn.py keep the families it
found working.

    python3 scripts/probe_families.py [--world 2] [--families llama,phi3,...]
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import harness  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo", "olmo2",
            "olmo3", "phi3", "glm", "glm4", "cohere", "stablelm", "starcoder2", "arcee", "apertus", "exaone4",
            "ernie4_5", "seed_oss", "hunyuan_v1_dense", "helium", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe",
            "olmoe", "flex_olmo", "ernie4_5_moe", "phimoe", "granitemoe", "gpt_oss", "minimax", "hunyuan_v1_moe",
            "llama4_text", "granitemoeshared", "glm4_moe", "nemotron", "deepseek_v2", "deepseek_v3", "qwen3_next", "lfm2")


LATENT = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1)
CONFIG = {  # what a family needs beyond the shared tiny sizes (multi-head latent attention's dimensions)
    "deepseek_v3": LATENT, "deepseek_v2": {**LATENT, "q_lora_rank": None, "topk_method": "greedy"}}


def tiny(name: str) -> torch.nn.Module:
    """A tiny random model of family `name` (float32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, num_local_experts=4,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, attn_implementation="eager",
              experts_implementation="eager")
    cfg = AutoConfig.for_model(name, **{**kw, **CONFIG.get(name, {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 or n.endswith("bias"):  # expert biases (GPT-OSS's) are 2-D
                p.add_(torch.randn_like(p), alpha=0.3)
    return model


def probe(world, families: list[str]) -> dict:
    import autofuse

    warnings.simplefilter("ignore")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))

    def loss(m):
        o = m(input_ids=ids, labels=ids)
        return o.logits, o.loss

    out = {}
    for name in families:
        try:
            base = tiny(name)
        except Exception as exc:  # noqa: BLE001 - a family this transformers cannot build: reported, not raised
            out[name] = f"no model here: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        try:
            want = harness.unsharded_run(copy.deepcopy(base).double(), loss)
        except Exception as exc:  # noqa: BLE001 - the tiny config does not suit this family: reported, not raised
            out[name] = f"the unsharded model fails here: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        try:
            forms = {}
            for sp in (False, True):
                got = harness.against(autofuse.parallelize(copy.deepcopy(base), world.group, sequence_parallel=sp),
                                      loss, want)
                ok = got["grad keys"] and got["state keys"]
                forms[f"sp={sp}"] = (f"logits {got['logits']:.1e} grads {got['worst grad']:.1e}"
                                     + ("" if ok else " KEYS DIFFER"))
            out[name] = "; ".join(f"{k}: {v}" for k, v in forms.items())
        except Exception as exc:  # noqa: BLE001 - a refusal (or a failure) is the result for this family
            out[name] = f"{type(exc).__name__}: {str(exc)[:240]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    job = functools.partial(probe, families=args.families.split(","))
    for name, line in harness.cpu_job(job, args.world)[0].items():
        print(f"{name:18s} {line}")


if __name__ == "__main__":
    main()
