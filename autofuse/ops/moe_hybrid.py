"""What MoE's `hybrid` variants share: the one-launch heap all-to-all (kernels/moe.py) beside the vendor
grouped GEMM, with nothing read by the host, so a call can be captured in a CUDA graph.

- The routing plan on the device: `order` by a stable sort, `sent` by scatter_add (torch.bincount
  would read the largest id on the host).
- The all-to-all (`Exchange`): one kernel launch exchanges the per-expert counts through the heap
  and pushes every row straight into its destination's fixed receive buffer at a row computed on
  the device from those counts; it writes a per-program fault word instead of raising.
- Capacity-bounded buffers: the receive side holds C = W * T * k rows whatever the routing; the
  group sizes stay on the device. The grouped GEMM (`grouped_mm`): torch._grouped_mm with the
  device offsets where it runs (CUDA, bfloat16, 16-byte aligned rows), else one matmul per expert
  over all C rows, kept where the row belongs to that expert (L times the work of the used rows: the
  fallback for CPU ranks and other dtypes, not the fast path). Rows beyond the used count are zero
  in `h`; in the handle's `rows` they hold whatever the buffer held (nothing reads them).
- The row epilogues (`activate`, `weighted_rows`; kernels/moe_rows.py): one pass each with the used
  count read on the device. Five torch passes over all C rows cost more than the expert GEMM at
  Mixtral T=4096 (round 14, 2x H200: the block 9.2 ms before, 4.8 ms after; bsp 8.7 ms).
- The handle is bsp's (autofuse/ops/moe.py): counts, sent, order, index (computed from the counts
  by searchsorted), weights, rows. So either combine takes either dispatch's handle.

Configs (the tuner's space): COMM_SMS (programs of the launch, at most one per BLOCK_R rows of the
rows one rank sends), BLOCK (elements a program copies per step: BLOCK_R rows x BLOCK_C columns,
BLOCK_C = min(BLOCK, next_pow2(H))), num_warps. Workspaces "<op>.hybrid" (counts inbox and flags,
parity sets) and "<op>.hybrid.fixed" (the receive buffer), shared by the op's hybrid runners.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autofuse.comm.workspace import Workspace, workspace
from autofuse.core.op import Config, Problem, SearchSpace, Variant
from autofuse.core.sizes import cdiv, next_pow2
from autofuse.ops import moe

if TYPE_CHECKING:
    from autofuse.comm.world import World

COMM_SMS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
KEYS = ("COMM_SMS", "BLOCK", "num_warps")
MAX_PROGRAMS = 128
FLAG_BASE, FLAG_KINDS = 16, 2  # kernels/moe.py's layout


def row_bytes(problem: Problem) -> int:
    """Bytes one rank sends (dispatch) or gets back (combine) per call: T * k rows of H."""
    return problem["T"] * problem["k"] * problem["H"] * problem.torch_dtype.itemsize


def receive_rows(problem: Problem) -> int:
    """Rows of the fixed heap buffer the all-to-all fills on each rank: dispatch's C received rows, combine's
    T * k returned ones."""
    return problem["C"] if problem.op == moe.DISPATCH else problem["T"] * problem["k"]


def fixed_bytes(problem: Problem) -> int:
    """Heap bytes the receive buffer's workspace takes (workspaces round each half up to a power of two)."""
    return 2 * next_pow2(cdiv(receive_rows(problem) * problem["H"] * problem.torch_dtype.itemsize, 2))


class HybridVariant(Variant):
    """The configs of both ops' hybrid variant (their runners differ)."""

    name, family = "hybrid", "hybrid"

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        return {"COMM_SMS": trial.suggest_categorical("COMM_SMS", list(COMM_SMS)),
                "BLOCK": trial.suggest_categorical("BLOCK", list(BLOCKS)),
                "num_warps": trial.suggest_categorical("num_warps", list(WARPS))}

    def defaults(self, problem: Problem) -> list[Config]:
        """By the bytes a rank moves: latency-bound few programs up to 256 KB, 16-32 up to 4 MB, then 64."""
        nbytes = row_bytes(problem)
        if nbytes <= 256 << 10:
            return [{"COMM_SMS": 4, "BLOCK": 2048, "num_warps": 4}, {"COMM_SMS": 8, "BLOCK": 4096, "num_warps": 4}]
        if nbytes <= 4 << 20:
            return [{"COMM_SMS": 16, "BLOCK": 4096, "num_warps": 8}, {"COMM_SMS": 32, "BLOCK": 8192, "num_warps": 8}]
        return [{"COMM_SMS": 64, "BLOCK": 8192, "num_warps": 8}, {"COMM_SMS": 32, "BLOCK": 16384, "num_warps": 16}]

    def check(self, problem: Problem, config: Config) -> str | None:
        unknown = sorted(set(config) - set(KEYS))
        missing = sorted(set(KEYS) - set(config))
        if unknown or missing:
            return f"takes exactly {', '.join(KEYS)} (unknown {unknown}, missing {missing})"
        sms = config["COMM_SMS"]
        if not isinstance(sms, int) or not 1 <= sms <= MAX_PROGRAMS:
            return f"COMM_SMS must be an int in 1..{MAX_PROGRAMS}, got {sms!r}"
        if config["BLOCK"] not in BLOCKS:
            return f"BLOCK must be one of {BLOCKS}, got {config['BLOCK']!r}"
        if config["num_warps"] not in WARPS:
            return f"num_warps must be one of {WARPS}, got {config['num_warps']!r}"
        return None


# -- the plan, the index and the grouped GEMM on the device -------------------------------------------
def send_plan(ids: torch.Tensor, experts: int, order: torch.Tensor, sent: torch.Tensor) -> None:
    """order = this rank's slots sorted by expert (stable), sent = rows per expert; no host read."""
    flat = ids.reshape(-1).long()
    order.copy_(torch.sort(flat, stable=True).indices)
    sent.zero_().scatter_add_(0, flat, torch.ones_like(flat))


def group_index(counts: torch.Tensor, capacity_rows: int) -> torch.Tensor:
    """moe.group_index without host reads: for each of the C grouped rows (by local expert, then
    source), its position in the source-major order; -1 beyond the used rows."""
    w, local = counts.shape
    sizes = counts.t().reshape(-1)  # group l * W + s
    ends = sizes.cumsum(0)
    p = torch.arange(capacity_rows, device=counts.device)
    g = torch.searchsorted(ends, p, right=True).clamp_(max=w * local - 1)
    within = p - (ends - sizes)[g]
    s, l = g % w, g // w
    per_source = counts.sum(1)
    index = (per_source.cumsum(0) - per_source)[s] + (counts.cumsum(1) - counts)[s, l] + within
    return torch.where(p < ends[-1], index, -1)


def inverse_index(index: torch.Tensor) -> torch.Tensor:
    """inv[m] = the grouped row whose source-major position is m (0 where no row has it)."""
    c = index.numel()
    inv = torch.zeros(c + 1, dtype=torch.int64, device=index.device)
    inv.scatter_(0, torch.where(index >= 0, index, c), torch.arange(c, device=index.device))
    return inv[:c]


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of `a` (C of them) grouped by expert, group l ending at row ends[l] (on the device), times
    w[l]: C x N; rows beyond ends[-1] unspecified. torch._grouped_mm where it runs, else a matmul per
    expert over every row, kept where the row is that expert's."""
    if a.is_cuda and hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16 \
            and (a.shape[1] * 2) % 16 == 0 and (w.shape[2] * 2) % 16 == 0:
        return torch._grouped_mm(a, w, offs=ends.to(torch.int32))
    group = torch.searchsorted(ends, torch.arange(a.shape[0], device=a.device), right=True)
    out = a.new_zeros(a.shape[0], w.shape[2])
    for l in range(w.shape[0]):
        out = torch.where((group == l)[:, None], a @ w[l], out)
    return out


# -- the row epilogues (kernels/moe_rows.py) ------------------------------------------------------------
def activate(pre: torch.Tensor, h: torch.Tensor, ends: torch.Tensor, fault: torch.Tensor, act: str) -> None:
    """h = act(pre) on the rows below ends[-1] (the used ones), 0 beyond (their pre is not read), NaN
    everywhere if `fault` (a device bool); one pass, nothing read on the host."""
    from autofuse.kernels import moe_rows

    rows, width = h.shape
    if pre.stride(-1) != 1 or pre.stride(0) != pre.shape[1] or pre.shape[1] != width * (2 if act == "swiglu" else 1):
        pre = pre.contiguous()
    block_c = min(256, next_pow2(width))
    block_r = max(1, min(64, 4096 // block_c))
    moe_rows.act_rows_kernel[(cdiv(rows, block_r), cdiv(width, block_c))](
        pre, h, ends, ends.numel() - 1, fault, rows, width,
        ACT=moe_rows.SWIGLU if act == "swiglu" else moe_rows.COPY, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


def weighted_rows(back: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                  fault: torch.Tensor) -> None:
    """out[t] = sum_j weights[t, j] * back[pos[t * k + j]] (float32 sums), NaN everywhere if `fault`."""
    from autofuse.kernels import moe_rows

    tokens, width = out.shape
    block_c = min(512, next_pow2(width))
    block_t = max(1, min(16, 2048 // block_c))
    moe_rows.weighted_sum_kernel[(cdiv(tokens, block_t), cdiv(width, block_c))](
        back, pos, weights.contiguous(), out, fault, tokens, width, TOPK=weights.shape[1], BLOCK_T=block_t,
        BLOCK_C=block_c, num_warps=4)


# -- the all-to-all -------------------------------------------------------------------------------------
class Exchange:
    """kernels/moe.py's all_to_all_kernel at one config, its workspaces and buffers, for `problem`'s
    direction: `receive_rows(problem)` x H rows land in this rank's fixed heap buffer `dst`."""

    def __init__(self, world: World, problem: Problem, config: Config, name: str):
        dst_rows = receive_rows(problem)
        w, e, k = world.size, problem["E"], problem["k"]
        self.world, self.width, self.dst_rows, self.topk = world, problem["H"], dst_rows, k
        self.experts, self.local = e, e // w
        self.block_c = min(config["BLOCK"], next_pow2(self.width))
        self.block_r = max(1, config["BLOCK"] // self.block_c)
        self.programs = max(1, min(config["COMM_SMS"], cdiv(problem["T"] * k, self.block_r)))
        self.num_warps = config["num_warps"]
        self.ws: Workspace = workspace(world, name, w * e * 4, FLAG_BASE + FLAG_KINDS * w * self.programs)
        self.fixed_ws: Workspace = workspace(world, name + ".fixed", fixed_bytes(problem) // 2)
        self.workspaces = (self.ws, self.fixed_ws)
        self.dst = self.fixed_ws.data.view(problem.torch_dtype)[:dst_rows * self.width].view(dst_rows, self.width)
        self.box, self.box_half = self.ws.data_view(torch.int32)
        self.e_p2, self.w_p2 = next_pow2(e), next_pow2(w)
        self.scratch = torch.empty(self.programs, self.e_p2, dtype=torch.int32, device=world.device)
        self.fault = torch.zeros(self.programs, dtype=torch.int32, device=world.device)
        self.dummy = torch.zeros(1, dtype=torch.int64, device=world.device)

    def __call__(self, mode: int, src: torch.Tensor, sent: torch.Tensor, ids: torch.Tensor | None = None,
                 order: torch.Tensor | None = None, inv: torch.Tensor | None = None,
                 counts_out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch (mode: kernels.moe DISPATCH or COMBINE); returns the call's fault as a device bool."""
        from autofuse.kernels import moe as k

        d = self.dummy
        ws = self.ws
        k.all_to_all_kernel[(self.programs,)](
            src, self.dst, sent, ids if ids is not None else d, order if order is not None else d,
            inv if inv is not None else d, counts_out if counts_out is not None else d, self.fault, self.scratch,
            self.box, self.box_half, ws.ctx, ws.flags, ws.half_flags, self.experts, self.local, self.topk,
            self.width, self.dst_rows, MODE=mode, W_P2=self.w_p2, E_P2=self.e_p2, BLOCK_R=self.block_r,
            BLOCK_C=self.block_c, num_warps=self.num_warps, num_stages=1)
        return self.fault.ne(0).any()
