"""Whole-model training steps through autofuse (CPU ranks): `autofuse bench train_model`'s contenders
train the tiny Llama to the unsharded model's losses, and the sequence-parallel entry's gradient
survives a compiled first layer."""
from __future__ import annotations

import warnings

import pytest
import torch

from autofuse.comm.world import spawn


def _entry_grads(world) -> dict[bool, list]:
    """The input gradient of a module whose forward pre-hook scatters the rows (`scatter_rows`, as
    `autofuse.parallelize` hooks the first sequence-parallel layer), eager and compiled in place."""
    from autofuse.nn import functional as tpf

    torch.set_num_threads(1)
    w = world.size

    def enter(module, args, kwargs):
        b, s, h = args[0].shape
        return (tpf.scatter_rows(args[0].reshape(b * s, h), world.group).view(b, s // w, h),), kwargs

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    grads = {}
    for compiled in (False, True):
        block = torch.nn.Sequential(lin)
        block.register_forward_pre_hook(enter, with_kwargs=True)
        if compiled:
            block.compile(fullgraph=True)
        x = (torch.arange(4.0 * w * 6).view(1, 4 * w, 6) / 10).requires_grad_()
        (block(x) * (world.rank + 1)).sum().backward()
        grads[compiled] = x.grad.tolist()
    return grads


def test_scatter_rows_gradient_under_a_compiled_module() -> None:
    """A compiled module whose pre-hook scatters: every rank's input gradient is the whole gathered one,
    as in eager (the scatter handed out a view of its input, which the compiled module's input handling
    re-derived from the base, so each rank's gradient held only its own rows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = spawn(_entry_grads, 2, device_kind="cpu", timeout_s=600)
    for grads in ranks:
        eager, compiled = torch.tensor(grads[False]), torch.tensor(grads[True])
        torch.testing.assert_close(compiled, eager)
        assert eager.abs().min() > 0  # every row's gradient reached the input


# World 4 (37 s on 2 cores) is in the sweep set: the layers' gradients at 4 ranks are checked by
# tests/test_nn.py and tests/test_train.py; world 2 keeps the whole step (loss, AdamW) in CI.
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.sweep)])
def test_bench_train_model_losses_match_the_unsharded_model_on_cpu(world) -> None:
    """`autofuse bench train_model` on CPU ranks, the tiny Llama (2 layers): autofuse eager and with its
    layers compiled (inductor), and torch's DTensor TP, train from the same weights on the same batches
    to the unsharded model's losses for the first steps (float32; AdamW's second and third steps read
    every gradient, so a wrong or missing one shows), and are timed; no speedup or MFU from the interpreter."""
    from autofuse.bench import bench_train_model
    from autofuse.bench.bench import BenchOptions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = bench_train_model.run(BenchOptions(target="train_model", reps=1, world=world,
                                                    progress=False).resolved())
    (row,) = result["rows"]
    assert result["contenders"] == ["autofuse", "autofuse-compiled", "torch-tp"], result["contenders"]
    assert any("torch-async-tp skipped" in n for n in result["notes"])
    assert result["layers"] == 2 and row["tokens"] == 16
    want = row["losses"]["unsharded"]
    assert len(want) == bench_train_model.LOSS_STEPS and len(set(want)) == len(want)  # the weights moved
    for name in result["contenders"]:
        torch.testing.assert_close(torch.tensor(row["losses"][name]), torch.tensor(want), rtol=1e-5, atol=0)
        assert row["loss_diff"][name]["unsharded"] <= result["loss_tolerance"], (name, row["loss_diff"])
    assert row["loss_ok"] and all(v > 0 for v in row["ms"].values())
    assert result["interpreted"] and row["speedup"] == {} and row["mfu"] == {}


def test_model_flops_count_layers_and_lm_head() -> None:
    """Model FLOPs of a training step: every decoder layer's (bench_train_layer.layer_flops) plus lm_head's
    3 x 2 x T x hidden x vocab (Llama-3-8B, 4 layers, 4K tokens)."""
    from types import SimpleNamespace

    from autofuse.bench.bench_train_layer import layer_flops
    from autofuse.bench.bench_train_model import MODELS, model_flops

    c = SimpleNamespace(**MODELS["8b"], num_hidden_layers=4)
    assert model_flops(c, 4096) == 4 * layer_flops(c, 4096) + 6 * 4096 * 4096 * 128256
