"""autofuse.nn.swiglu: the SwiGLU kernels (forward, backward) under Triton's interpreter against float64,
and which MLPs run through them."""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn

import autofuse  # noqa: F401  (sets TRITON_INTERPRET on a machine without GPUs)
from autofuse.nn.linear import FusedPart
from autofuse.nn.swiglu import FusedForward, fuse_gated_mlp, gated_silu_mlp, swiglu, swiglu_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach()
    return float((got.detach().double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,layout", [((4, 2 * 1100), "rows"), ((2, 3, 2 * 5), "rows"), ((6, 2 * 40), "transposed")])
def test_swiglu_matches_float64(dtype, shape, layout) -> None:
    """Values and the whole row's gradient (d gate, d up side by side) within the dtype's rounding of the
    float64 formula: a width over one program's block (masked tail), a 3-D input, and column-major
    input and output gradient (read through `contiguous`)."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        pytest.skip("no GPU and no interpreter")
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    dy64 = torch.randn(*shape[:-1], shape[-1] // 2, generator=g, dtype=torch.float64)
    if layout == "transposed":
        x = x64.t().contiguous().to(dtype).t().requires_grad_()
        dy = dy64.t().contiguous().to(dtype).t()
        assert not x.is_contiguous() and not dy.is_contiguous()
    else:
        x, dy = x64.to(dtype).requires_grad_(), dy64.to(dtype)
    y = swiglu(x)
    y.backward(dy)
    ref = x.detach().double().requires_grad_()
    want = swiglu_reference(ref)
    want.backward(dy.double())
    assert y.dtype == dtype and y.shape == want.shape and x.grad.shape == x.shape
    assert _rel(y, want) <= TOL[dtype] and _rel(x.grad, ref.grad) <= 2 * TOL[dtype]


def test_swiglu_edges() -> None:
    """No rows: empty results, no launch; an odd last dim is refused; float64 and fake tensors take torch's
    formula."""
    x = torch.zeros(0, 8, requires_grad=True)
    y = swiglu(x)
    y.sum().backward()
    assert y.shape == (0, 4) and x.grad.shape == (0, 8)
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 7))
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(swiglu(x), swiglu_reference(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # shape inference: no data to launch a kernel on
        fake = torch.empty(4, 10, requires_grad=True)
        out = swiglu(fake)
        out.sum().backward()
    assert out.shape == (4, 5) and fake.grad.shape == (4, 10)


def _mlp(act: str = "silu") -> nn.Module:
    """A transformers LlamaMLP (hidden 8, intermediate 16) fed its fused gate/up output, as
    autofuse.nn.llama leaves it under sequence parallelism: gate and up FusedParts side by side."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, hidden_act=act))
    mlp.gate_proj, mlp.up_proj = FusedPart(0, 16), FusedPart(16, 32)
    return mlp


def test_a_gated_silu_mlp_runs_one_swiglu_and_keeps_its_results() -> None:
    """LlamaMLP with SiLU: its forward becomes FusedForward, with the block's own values and gradients
    (float32, against the unchanged block); set once; a deep copy's forward runs the copy's weights; a
    pickled and loaded block runs it too."""
    mlp, plain = _mlp(), _mlp()
    assert gated_silu_mlp(mlp) and fuse_gated_mlp(mlp) and isinstance(vars(mlp)["forward"], FusedForward)
    assert not fuse_gated_mlp(mlp)  # once
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mlp(xa), plain(xb)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6) and torch.allclose(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(mlp.down_proj.weight.grad, plain.down_proj.weight.grad, rtol=1e-5, atol=1e-6)
    twin = copy.deepcopy(mlp)
    with torch.no_grad():
        twin.down_proj.weight.mul_(2)
    assert vars(twin)["forward"].mlp is twin
    assert torch.allclose(twin(x), 2 * mlp(x), rtol=1e-5, atol=1e-6)
    buf = io.BytesIO()
    torch.save(mlp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.allclose(loaded(x), mlp(x))


def test_other_mlps_keep_their_own_forward() -> None:
    """Not SiLU (GELU), a subclass whose forward differs, parts not side by side or of unequal widths,
    and plain nn.Linear projections: nothing changes."""
    assert not fuse_gated_mlp(_mlp("gelu"))

    class Scaled(type(_mlp())):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)

    odd = _mlp()
    odd.__class__ = Scaled
    assert not fuse_gated_mlp(odd)
    swapped = _mlp()
    swapped.gate_proj, swapped.up_proj = FusedPart(16, 32), FusedPart(0, 16)
    assert not fuse_gated_mlp(swapped)
    uneven = _mlp()
    uneven.gate_proj, uneven.up_proj = FusedPart(0, 16), FusedPart(16, 40)
    assert not fuse_gated_mlp(uneven)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    assert not fuse_gated_mlp(LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2)))


def test_fused_forward_takes_any_other_input_through_the_blocks_own_forward() -> None:
    """An input whose last dim is not the fused width (a caller's own use of the block) runs the
    block's own forward and fails as it would."""
    mlp = _mlp()
    fuse_gated_mlp(mlp)
    with pytest.raises(RuntimeError):
        mlp(torch.randn(2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_swiglu_matches_float64_eagerly_and_under_graph_replay(dtype) -> None:
    """On a GPU: the compiled kernels' values and gradients (a 70B TP=2 row width, F = 14336) against the
    float64 formula, eagerly and replayed from a CUDA graph that captured forward and backward on fresh
    inputs copied into its static ones."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(64, 2 * 14336, generator=g, device=dev, dtype=torch.float64) * 2,
                torch.randn(64, 14336, generator=g, device=dev, dtype=torch.float64))

    def check(x64, dy64, y, dx) -> None:
        ref = x64.clone().requires_grad_()
        want = swiglu_reference(ref)
        want.backward(dy64)
        assert _rel(y, want) <= TOL[dtype] and _rel(dx, ref.grad) <= 2 * TOL[dtype]

    x64, dy64 = pair()
    x = x64.to(dtype).requires_grad_()
    y = swiglu(x)
    y.backward(dy64.to(dtype))
    check(x.detach().double(), dy64.to(dtype).double(), y, x.grad)
    xs, dys = x64.to(dtype).requires_grad_(), dy64.to(dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        torch.autograd.grad(swiglu(xs), xs, dys)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = swiglu(xs)
        (dxs,) = torch.autograd.grad(ys, xs, dys)
    for _ in range(2):
        x64, dy64 = pair()
        with torch.no_grad():
            xs.copy_(x64)
            dys.copy_(dy64)
        graph.replay()
        torch.cuda.synchronize()
        check(xs.detach().double(), dys.double(), ys, dxs)
