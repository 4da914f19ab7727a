"""The projection sets autofuse knows in a decoder layer's attention and MLP (transformers' names), each a
`Block`: column projections reading the block's input and one row projection writing its output; and the two
forms a block's output takes (a tensor, or a tuple led by one: `first`, `with_first`). Read by
`autofuse.nn.llama` (whole decoder layers) and `autofuse.nn.moe_tp` (an MoE block's shared expert)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Block:
    """One form of a decoder layer's attention or MLP: `columns`, the nn.Linear projections reading the
    block's input (column-parallel, outputs side by side), and `row`, the one writing its output
    (row-parallel). A fused projection (`qkv_proj`: q, k, v; `gate_up_proj`: gate, up) holds several
    parts side by side; rank r keeps its block of each."""

    columns: tuple[str, ...]
    row: str

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.columns, self.row)

    def __str__(self) -> str:
        return "/".join(self.names)


ATTENTION_FORMS = (Block(("q_proj", "k_proj", "v_proj"), "o_proj"),  # Llama, Mistral, Qwen, Gemma, ...
                   Block(("qkv_proj",), "o_proj"))                    # Phi-3 / Phi-4: q, k, v fused
MLP_FORMS = (Block(("gate_proj", "up_proj"), "down_proj"),           # gated (SwiGLU, GeGLU)
             Block(("gate_up_proj",), "down_proj"),                  # gated, fused: Phi-3, GLM-4 (chunk(2))
             Block(("up_proj",), "down_proj"),                       # ungated: Arcee, Apertus
             Block(("c_fc",), "c_proj"))                             # ungated: StarCoder2


def form_of(block: nn.Module | None, forms: tuple[Block, ...]) -> Block | None:
    """The first of `forms` whose projections are all nn.Linear layers of `block`, else None."""
    for form in forms:
        if block is not None and all(isinstance(getattr(block, n, None), nn.Linear) for n in form.names):
            return form
    return None


def first(output: Any) -> torch.Tensor:
    """A module's main output: `output` itself, or the first item of a tuple (transformers' layers and MoE
    blocks return (hidden, router logits, ...))."""
    return output[0] if isinstance(output, tuple) else output


def with_first(output: Any, value: torch.Tensor) -> Any:
    """`output` in its own form with `value` as its main output (`first`)."""
    return (value, *output[1:]) if isinstance(output, tuple) else value
