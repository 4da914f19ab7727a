"""torch's symmetric-memory ops stood in for on CPU ranks, to test the torch_symm (peer) runners' wiring.

The peer variants call `torch.ops.symm_mem` ops that torch builds for CUDA only, so on CPU ranks
(gloo) `stand_ins()` registers CPU kernels for them under torch's own schemas (the dispatcher checks
every call's arguments against the schema, as on a GPU) and lets the variants run on CPU:
- `one_shot_all_reduce_out`, `two_shot_all_reduce_`: gloo's all_reduce of the input;
- `fused_all_gather_matmul`: torch's own fallback (its Meta kernel: all-gather, then matmul);
- `fused_all_gather_scaled_matmul`: torch's fallback restated with the gathers moving bytes (gloo
  has no float8), A's scale read by torch's own scale-mode rule as the CUDA kernel reads it (a scale
  it would take for another mode than meant gives a wrong result or an error here too);
- `fused_matmul_reduce_scatter`, `fused_scaled_matmul_reduce_scatter`: torch's own CUDA kernels
  (the Python that runs on a GPU: A split into row chunks, a row-wise A_scale checked against A's
  rows and split with them, the chunks' products exchanged, summed and shaped), with only the
  symmetric-memory exchange they call, `_pipelined_produce_and_all2all`, stood in for by byte gathers;
- `symm.empty` makes a plain tensor and `symm.rendezvous` does nothing.
What this cannot check: the CUDA kernels themselves, their pipelining and CUDA-graph capture.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm
from torch.distributed import distributed_c10d as c10d

from autofuse.comm.world import all_gather_single

_registered: list[torch.library.Library] = []


def _one_shot(inp: torch.Tensor, reduce_op: str, group_name: str, out: torch.Tensor) -> torch.Tensor:
    out.copy_(inp)
    dist.all_reduce(out, group=c10d._resolve_process_group(group_name))
    return out


def _two_shot(inp: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    dist.all_reduce(inp, group=c10d._resolve_process_group(group_name))
    return inp


def _gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_gather along dim 0, as bytes."""
    out = torch.empty((group.size() * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    all_gather_single(out.view(torch.uint8), t.contiguous().view(torch.uint8), group=group)
    return out


def _produce_and_all2all(chunk_producer: Callable[[int, torch.Tensor], None], output: torch.Tensor,
                         group_name: str, out_chunk_dim: int = 0) -> None:
    """torch's `_pipelined_produce_and_all2all` without symmetric memory: this rank produces every
    destination rank's chunk, the ranks gather them all (as bytes), and output's chunk q is what rank q
    produced for this rank (the all-to-all its docstring states)."""
    group = c10d._resolve_process_group(group_name)
    w, me = group.size(), group.rank()
    out_chunks = output.chunk(w, dim=out_chunk_dim)
    mine = torch.empty((w, *out_chunks[0].shape), dtype=output.dtype, device=output.device)
    for dst in range(w):
        chunk_producer(dst, mine[dst])
    every = _gather_rows(mine, group)  # rank q's chunk for rank d at q * w + d
    for q, chunk in enumerate(out_chunks):
        chunk.copy_(every[q * w + me])


def _scaled(a_shard: torch.Tensor, bs: list, a_scale: torch.Tensor, b_scales: list, gather_dim: int,
            group_name: str, biases: list, result_scales: list, out_dtypes: list, use_fast_accum: list
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if gather_dim != 0:
        raise NotImplementedError("the CPU stand-in gathers rows (gather_dim 0) only")
    group = c10d._resolve_process_group(group_name)
    mode = symm._check_and_verify_fp8_all_gather_scale_mode(a_shard, a_scale, gather_dim, group.size())
    if mode == symm._ScaleMode.ROW_WISE_SHARDED:
        a_scale = _gather_rows(a_scale, group)
    elif mode != symm._ScaleMode.TENSOR_WISE:
        raise NotImplementedError(f"the CPU stand-in takes tensor-wise and row-wise-sharded scales, not {mode}")
    a = _gather_rows(a_shard, group)
    out_dtypes = symm._maybe_convert_scalar_types_to_dtypes(out_dtypes)  # the schema's ScalarType?[]: ints here
    return a, [torch._scaled_mm(a, b, a_scale, sb, bias, rs, out_dtype=dt, use_fast_accum=fast)
               for b, sb, bias, rs, dt, fast in zip(bs, b_scales, biases, result_scales, out_dtypes, use_fast_accum)]


def _register() -> None:
    if _registered:
        return
    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("one_shot_all_reduce_out", _one_shot, "CPU")
    lib.impl("two_shot_all_reduce_", _two_shot, "CPU")
    lib.impl("fused_all_gather_matmul", symm._fused_all_gather_matmul_fallback, "CPU")
    lib.impl("fused_all_gather_scaled_matmul", _scaled, "CPU")
    lib.impl("fused_matmul_reduce_scatter", symm._fused_matmul_reduce_scatter, "CPU")
    lib.impl("fused_scaled_matmul_reduce_scatter", symm._fused_scaled_matmul_reduce_scatter, "CPU")
    _registered.append(lib)


@contextlib.contextmanager
def stand_ins(*modules: object) -> Iterator[None]:
    """CPU kernels for the symm_mem ops (kept for the process; the reduce-scatters' exchange is stood in
    for only while inside), plain tensors for symm.empty, and `torch_symm_unavailable` answering None
    in each of `modules` (the op modules) while inside."""
    _register()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(symm, "_pipelined_produce_and_all2all", _produce_and_all2all))
        stack.enter_context(mock.patch.object(symm, "empty", lambda shape, dtype, device: torch.empty(
            shape, dtype=dtype, device=device)))
        stack.enter_context(mock.patch.object(symm, "rendezvous", lambda t, group: None))
        for module in modules:
            stack.enter_context(mock.patch.object(module, "torch_symm_unavailable", lambda world, op: None))
        yield
