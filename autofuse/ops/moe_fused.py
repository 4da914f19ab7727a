"""MoE's `fused` variants, host side (kernels/moe_fused.py): grouped GEMMs that move rows themselves.

- moe_combine: the grouped GEMM whose epilogue stores each output row into its token's rank's return
  buffer, then the top-k weighted sum (kernels/moe_rows.py). The return all-to-all of `hybrid` (a second
  launch after the vendor grouped GEMM) becomes the GEMM's own stores, so rows travel while later tiles
  compute.
- moe_dispatch: one launch whose mover programs push the token rows into their experts' ranks' receive
  buffers while its other programs run the first grouped GEMM (+ SwiGLU), each tile as soon as the rows it
  covers have landed; then a settle pass (zero beyond the used rows, NaN if the call failed).

The GEMMs are autofuse's (kernels/gemm_core.py's tile loop over pointers), not the vendor's: where the
vendor grouped GEMM is much faster than the all-to-all costs, `hybrid` wins, and the tuner measures which.

Configs (the tuner's space): BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M (m-tiles walked together over
the n-tiles: L2 reuse of the weights), num_warps; dispatch adds the movers' COMM_SMS and BLOCK (as
`hybrid`'s). A launch has one program per SM (programs wait for each other, so all must be resident; on
CPU ranks the movers and two more). Workspaces "<op>.fused" (counts inbox and flags) and "<op>.fused.fixed"
(combine's return buffer, T * k rows of H; dispatch's receive buffer, C rows of H).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autofuse.comm.workspace import Workspace, workspace
from autofuse.core.op import Config, Problem, SearchSpace, Variant
from autofuse.core.sizes import cdiv, next_pow2
from autofuse.ops import moe, moe_hybrid

if TYPE_CHECKING:
    from autofuse.comm.world import World

BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (64, 128, 256)
BLOCK_KS = (32, 64, 128)
STAGES = (2, 3, 4)
WARPS = (4, 8)
GROUP_MS = (1, 4, 8)
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES", "GROUP_M", "num_warps")
CPU_PROGRAMS = 2
FLAG_BASE, FLAG_KINDS = 16, 2  # kernels/moe_fused.py's layout
SMEM_BYTES = 227 << 10  # Hopper's shared memory per block (opt-in)
INT32_MAX = 2**31 - 1
MOVERS = (1, 2, 4, 8, 16, 32, 64)  # the fused dispatch's mover programs
MOVER_KEYS = ("COMM_SMS", "BLOCK")  # the fused dispatch's movers, as hybrid's all-to-all takes them
ACC_PER_WARP = 2048  # SwiGLU's two accumulators: BLOCK_M * BLOCK_N elements a tile per warp before spills


def return_bytes(problem: Problem) -> int:
    """Heap bytes of the return buffer: T * k rows of H (workspaces round each half to a power of two)."""
    return 2 * next_pow2(cdiv(problem["T"] * problem["k"] * problem["H"] * problem.torch_dtype.itemsize, 2))


class FusedVariant(Variant):
    """The fused combine's configs (its runner is moe_combine's FusedRunner); dispatch's adds the movers'."""

    name, family = "fused", "fused"
    keys = KEYS

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        return {"BLOCK_M": trial.suggest_categorical("BLOCK_M", list(BLOCK_MS)),
                "BLOCK_N": trial.suggest_categorical("BLOCK_N", list(BLOCK_NS)),
                "BLOCK_K": trial.suggest_categorical("BLOCK_K", list(BLOCK_KS)),
                "NUM_STAGES": trial.suggest_categorical("NUM_STAGES", list(STAGES)),
                "GROUP_M": trial.suggest_categorical("GROUP_M", list(GROUP_MS)),
                "num_warps": trial.suggest_categorical("num_warps", list(WARPS))}

    def defaults(self, problem: Problem) -> list[Config]:
        """Small row tiles where a rank gets few rows per expert (decode), 128 x 128 where it gets many."""
        rows_per_expert = problem["T"] * problem["k"] / max(1, moe.local_experts(problem))
        small = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 1, "num_warps": 4}
        large = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 8, "num_warps": 8}
        return [small, large] if rows_per_expert < 256 else [large, small]

    def check(self, problem: Problem, config: Config) -> str | None:
        unknown = sorted(set(config) - set(self.keys))
        missing = sorted(set(self.keys) - set(config))
        if unknown or missing:
            return f"takes exactly {', '.join(self.keys)} (unknown {unknown}, missing {missing})"
        for key, allowed in (("BLOCK_M", BLOCK_MS), ("BLOCK_N", BLOCK_NS), ("BLOCK_K", BLOCK_KS),
                             ("NUM_STAGES", STAGES), ("GROUP_M", GROUP_MS), ("num_warps", WARPS)):
            if config[key] not in allowed:
                return f"{key} must be one of {allowed}, got {config[key]!r}"
        size = problem.torch_dtype.itemsize
        smem = config["NUM_STAGES"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * size
        if smem > SMEM_BYTES:
            return f"{smem} B of shared memory for the pipeline, more than {SMEM_BYTES}"
        if problem["C"] * problem["F"] > INT32_MAX or problem["F"] * problem["H"] > INT32_MAX:
            return "h (C x F) or one expert's w2 (F x H) has more than 2**31 elements (32-bit tile offsets)"
        return None


class FusedDispatchVariant(FusedVariant):
    """The fused dispatch's configs: the GEMM's, plus the movers' COMM_SMS and BLOCK (moe_hybrid's)."""

    keys = KEYS + MOVER_KEYS

    def space(self, trial: SearchSpace, problem: Problem) -> Config:
        return {**super().space(trial, problem),
                "COMM_SMS": trial.suggest_categorical("COMM_SMS", list(MOVERS)),
                "BLOCK": trial.suggest_categorical("BLOCK", list(moe_hybrid.BLOCKS))}

    def defaults(self, problem: Problem) -> list[Config]:
        """combine's GEMM tiles (16-row ones at decode: rows @ w1 is read-bound there), hybrid's movers."""
        gemm = super().defaults(problem)
        if problem["T"] * problem["k"] / max(1, moe.local_experts(problem)) < 64:
            gemm = [{**gemm[0], "BLOCK_M": 16}, gemm[0]]
        hybrid = moe_hybrid.HybridVariant().defaults(problem)[0]
        return [{**g, **{n: hybrid[n] for n in MOVER_KEYS}} for g in gemm]

    def check(self, problem: Problem, config: Config) -> str | None:
        why = super().check(problem, config)
        if why:
            return why
        if config["COMM_SMS"] not in MOVERS:
            return f"COMM_SMS must be one of {MOVERS}, got {config['COMM_SMS']!r}"
        if config["BLOCK"] not in moe_hybrid.BLOCKS:
            return f"BLOCK must be one of {moe_hybrid.BLOCKS}, got {config['BLOCK']!r}"
        if problem["act"] == "swiglu" and config["BLOCK_M"] * config["BLOCK_N"] > ACC_PER_WARP * config["num_warps"]:
            return (f"SwiGLU keeps two float32 {config['BLOCK_M']} x {config['BLOCK_N']} accumulators: more than "
                    f"{ACC_PER_WARP * config['num_warps']} elements a tile at num_warps={config['num_warps']} spill")
        if problem["C"] * problem["H"] > INT32_MAX or problem["H"] * problem["F"] * 2 > INT32_MAX:
            return "the receive rows (C x H) or one expert's w1 (H x 2F) has more than 2**31 elements (32-bit offsets)"
        return None


def programs(world: World) -> int:
    """Programs of a fused launch: one per SM (all resident), two on CPU ranks (the interpreter)."""
    if world.device.type == "cuda":
        return torch.cuda.get_device_properties(world.device).multi_processor_count
    return CPU_PROGRAMS


class CombineGemm:
    """kernels/moe_fused.py's combine_gemm_kernel at one config, with its workspaces and return buffer
    (`dst`, T * k x H in this rank's send order)."""

    def __init__(self, world: World, problem: Problem, config: Config, name: str):
        w, e = world.size, problem["E"]
        self.world, self.config = world, dict(config)
        self.experts, self.local, self.ffn, self.hidden = e, e // w, problem["F"], problem["H"]
        self.dst_rows = problem["T"] * problem["k"]
        self.programs = programs(world)
        self.ws: Workspace = workspace(world, name, w * e * 4, FLAG_BASE + FLAG_KINDS * w * self.programs)
        self.fixed_ws: Workspace = workspace(world, name + ".fixed", return_bytes(problem) // 2)
        self.workspaces = (self.ws, self.fixed_ws)
        dt = problem.torch_dtype
        self.dst = self.fixed_ws.data.view(dt)[:self.dst_rows * self.hidden].view(self.dst_rows, self.hidden)
        self.box, self.box_half = self.ws.data_view(torch.int32)
        self.fault = torch.zeros(self.programs, dtype=torch.int32, device=world.device)

    def __call__(self, h: torch.Tensor, w2: torch.Tensor, index: torch.Tensor, counts: torch.Tensor,
                 sent: torch.Tensor) -> torch.Tensor:
        """Launch; returns the call's fault as a device bool. counts: the handle's W x L (group sizes)."""
        from autofuse.kernels import moe_fused as k

        c = self.config
        sizes = counts.sum(0)
        ends = sizes.cumsum(0)
        tile_ends = ((sizes + c["BLOCK_M"] - 1) // c["BLOCK_M"]).cumsum(0)
        ws = self.ws
        k.combine_gemm_kernel[(self.programs,)](
            h, w2, index, ends, tile_ends, self.dst, sent, self.fault, self.box, self.box_half, ws.ctx, ws.flags,
            ws.half_flags, self.experts, self.local, self.ffn, self.hidden, self.dst_rows,
            W_P2=next_pow2(self.world.size), E_P2=next_pow2(self.experts), L_P2=next_pow2(self.local),
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], NUM_STAGES=c["NUM_STAGES"],
            GROUP_M=c["GROUP_M"], num_warps=c["num_warps"])
        return self.fault.ne(0).any()


class DispatchGemm:
    """kernels/moe_fused.py's dispatch_gemm_kernel at one config, with its workspaces and receive buffer
    (`rows`, C x H: the handle's rows), then the settle pass over h."""

    def __init__(self, world: World, problem: Problem, config: Config, name: str):
        w, e, k = world.size, problem["E"], problem["k"]
        self.world, self.config = world, dict(config)
        self.experts, self.local, self.topk = e, e // w, k
        self.hidden, self.ffn, self.swiglu = problem["H"], problem["F"], problem["act"] == "swiglu"
        self.block_c = min(config["BLOCK"], next_pow2(self.hidden))
        self.block_r = max(1, config["BLOCK"] // self.block_c)
        self.movers = max(1, min(config["COMM_SMS"], cdiv(problem["T"] * k, self.block_r)))
        computers = CPU_PROGRAMS
        if world.device.type == "cuda":  # all resident: movers + computers = SMs, at most half of them moving
            sms = programs(world)
            self.movers = min(self.movers, max(1, sms // 2))
            computers = sms - self.movers
        self.programs = self.movers + max(1, computers)
        self.ws: Workspace = workspace(world, name, w * e * 4, FLAG_BASE + FLAG_KINDS * w * self.movers)
        self.fixed_ws: Workspace = workspace(world, name + ".fixed", moe_hybrid.fixed_bytes(problem) // 2)
        self.workspaces = (self.ws, self.fixed_ws)
        c = problem["C"]
        self.rows = self.fixed_ws.data.view(problem.torch_dtype)[:c * self.hidden].view(c, self.hidden)
        self.box, self.box_half = self.ws.data_view(torch.int32)
        self.e_p2, self.w_p2, self.l_p2 = next_pow2(e), next_pow2(w), next_pow2(self.local)
        self.scratch = torch.empty(self.movers, self.e_p2, dtype=torch.int32, device=world.device)
        self.fault = torch.zeros(self.programs, dtype=torch.int32, device=world.device)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, order: torch.Tensor, sent: torch.Tensor,
                 w1: torch.Tensor, h: torch.Tensor, counts: torch.Tensor) -> None:
        """Launch, then settle h (zero beyond the used rows, NaN everywhere if any program failed)."""
        from autofuse.kernels import moe_fused as k
        from autofuse.kernels import moe_rows

        c, ws = self.config, self.ws
        k.dispatch_gemm_kernel[(self.programs,)](
            x, self.rows, w1, h, sent, ids, order, counts, self.fault, self.scratch, self.box, self.box_half,
            ws.ctx, ws.flags, ws.half_flags, self.experts, self.local, self.topk, self.hidden, self.ffn,
            (2 if self.swiglu else 1) * self.ffn, self.movers,
            SWIGLU=self.swiglu, W_P2=self.w_p2, E_P2=self.e_p2, L_P2=self.l_p2, BLOCK_R=self.block_r,
            BLOCK_C=self.block_c, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
            NUM_STAGES=c["NUM_STAGES"], GROUP_M=c["GROUP_M"], num_warps=c["num_warps"])
        ends = counts.sum(0).cumsum(0)
        rows, width = h.shape
        block_c = min(256, next_pow2(width))
        block_r = max(1, min(64, 4096 // block_c))
        moe_rows.settle_rows_kernel[(cdiv(rows, block_r),)](
            h, ends, ends.numel() - 1, self.fault.ne(0).any(), rows, width, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=4)
