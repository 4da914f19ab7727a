"""moe_combine's `fused` variant, host side: the grouped GEMM whose epilogue stores each output row into its
token's rank's return buffer (kernels/moe_fused.py), then the top-k weighted sum (kernels/moe_rows.py).

The return all-to-all of `hybrid` (a second launch after the vendor grouped GEMM) becomes the GEMM's
own stores, so rows travel while later tiles compute. The GEMM is autofuse's (kernels/gemm_core.py's
tile loop over pointers), not the vendor's: where the vendor grouped GEMM is much faster than the
all-to-all costs, `hybrid` wins, and the tuner measures which.

Configs (the tuner's space): BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M (m-tiles walked together over
the n-tiles: L2 reuse of w2), num_warps. The launch has one
program per SM (every program waits for its peers' same-index program at the end, so all must be
resident; on CPU ranks two). Workspaces "moe_combine.fused" (counts inbox and flags) and
"moe_combine.fused.fixed" (the return buffer, T * k rows of H).
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


def return_bytes(problem: Problem) -> int:
    """Heap bytes of the return buffer: T * k rows of H (workspaces round each half to a power of two)."""
    return 2 * next_pow2(cdiv(problem["T"] * problem["k"] * problem["H"] * problem.torch_dtype.itemsize, 2))


class FusedVariant(Variant):
    """The fused combine's configs (its runner is moe_combine's FusedRunner)."""

    name, family = "fused", "fused"

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
        unknown = sorted(set(config) - set(KEYS))
        missing = sorted(set(KEYS) - set(config))
        if unknown or missing:
            return f"takes exactly {', '.join(KEYS)} (unknown {unknown}, missing {missing})"
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


class CombineGemm:
    """kernels/moe_fused.py's combine_gemm_kernel at one config, with its workspaces and return buffer
    (`dst`, T * k x H in this rank's send order)."""

    def __init__(self, world: World, problem: Problem, config: Config, name: str):
        w, e = world.size, problem["E"]
        self.world, self.config = world, dict(config)
        self.experts, self.local, self.ffn, self.hidden = e, e // w, problem["F"], problem["H"]
        self.dst_rows = problem["T"] * problem["k"]
        if world.device.type == "cuda":
            self.programs = torch.cuda.get_device_properties(world.device).multi_processor_count
        else:
            self.programs = CPU_PROGRAMS
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
