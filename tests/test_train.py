"""Training through autofuse: the `train` sweep holds exactly the GEMMs a sequence-parallel layer's
step calls, and the compiled layer's loss and gradients equal the unsharded layer's (CPU ranks)."""
from __future__ import annotations

import os

import pytest
import torch

from autofuse.comm.world import spawn
from autofuse.core import shapes
from autofuse.core.op import Problem

TOKENS = 16
TINY = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "intermediate_size": 128}


def _tiny_model() -> shapes.Model:
    return shapes.Model("tiny", TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"],
                        TINY["head_dim"], TINY["intermediate_size"])


def _dispatched(world) -> dict[str, list[str]]:
    """The problems one forward + backward of the sequence-parallel tiny layer dispatches, per setting of
    AUTOFUSE_SAVE_GATHERED (each run in a fresh dispatch state)."""
    import copy

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from autofuse.dispatch.state import STATE
    from autofuse.nn.llama import parallelize_layer

    torch.set_num_threads(1)
    config = LlamaConfig(**TINY, num_hidden_layers=1, vocab_size=128, rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    whole = LlamaDecoderLayer(config, 0)
    rotary = LlamaRotaryEmbedding(config)
    out = {}
    for save in ("1", "0"):
        os.environ["AUTOFUSE_SAVE_GATHERED"] = save
        STATE.cache.clear()
        layer = parallelize_layer(copy.deepcopy(whole), world.group, sequence_parallel=True)
        t_r = TOKENS // world.size
        x = torch.randn(1, t_r, config.hidden_size, generator=torch.Generator().manual_seed(1)).requires_grad_()
        pos = torch.arange(TOKENS)[None]
        y = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
        (y[0] if isinstance(y, tuple) else y).square().mean().backward()
        out[save] = sorted({e.choice.problem.key for e in STATE.cache.values()})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_train_sweep_holds_every_gemm_of_a_training_step(world) -> None:
    """What `autofuse tune --sweep train` tunes (autofuse.core.shapes.train_gemms) is exactly what the
    layer's forward and backward dispatch, with the gathered input kept and gathered again: a backward
    GEMM missing from the sweep (or a sweep problem no step calls) fails this."""
    got = spawn(_dispatched, world, device_kind="cpu", timeout_s=600)[0]
    for save, flag in ((True, "1"), (False, "0")):
        want = sorted({Problem.make(g.op, "float32", world, **dict(g.dims)).key
                       for g in shapes.train_gemms(_tiny_model(), world, TOKENS, save_gathered=save)})
        assert got[flag] == want, (save, got[flag], want)


def test_train_sweep_is_the_models_training_gemms() -> None:
    """The GPU `train` sweep: Llama-3 70B and 8B at 2K-8K tokens, both ag_gemm forms, bf16."""
    from autofuse.core import registry

    ag, rs = registry.get("ag_gemm").sweep("train", 2), registry.get("gemm_rs").sweep("train", 2)
    assert {p["gather"] for p in ag} == {"rows", "k"} and all(p.dtype == "bfloat16" for p in ag + rs)
    assert {p["M"] for p in rs} == set(shapes.TRAIN_TOKENS)
    assert registry.get("gemm_ar").sweep("train", 2) == []
    # the 70B gate_up's dA at 8K tokens: gemm_rs M=8192, N=hidden, K=2 x ffn
    assert Problem.make("gemm_rs", "bfloat16", 2, M=8192, N=8192, K=2 * 28672) in rs
