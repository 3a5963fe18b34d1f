"""Which slice of each checkpoint tensor a tensor-parallel rank reads (the layout of `hsmc.models.parallel`).

A rank reads only its slice of a tensor (`safe_open(...).get_slice`), so no process holds the whole model: q/k/v
and gate/up split their output rows, o_proj and down_proj their input columns, the embedding and LM head their
vocabulary rows (ceil(V/N) per rank, the last padded with zeros). Norms stay whole. An FP8 weight's
`weight_scale_inv` splits with it, block for block, which is exact only where every rank's slice starts on a
scale-block boundary (`check_scale_blocks`). A row-parallel bias is added by rank 0 alone (its all-reduce sums the
ranks' partial products).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hsmc.errors import ModelLoadError
from hsmc.models.parallel import TensorParallel

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split over the ranks
ROW = ("o_proj", "down_proj")  # input columns split over the ranks
VOCAB = ("embed_tokens", "lm_head")  # vocabulary rows split over the ranks


def split_dim(key: str) -> int | None:
    """The dimension checkpoint tensor `key` splits along (None: every rank reads it whole)."""
    module = key.rsplit(".", 2)[-2]
    if module in COLUMN or module in VOCAB:
        return 0
    if module in ROW and not key.endswith(".bias"):
        return 1
    return None


def read_shard(st: Any, key: str, tp: TensorParallel) -> torch.Tensor:
    """The rank's part of tensor `key` of the open safetensors file `st`; only its bytes are read."""
    dim = split_dim(key)
    if tp.world_size == 1 or (dim is None and not key.endswith(".bias")):
        return st.get_tensor(key)
    if dim is None:  # a row-parallel bias
        bias = st.get_tensor(key)
        return bias if tp.rank == 0 else torch.zeros_like(bias)
    view = st.get_slice(key)
    size = view.get_shape()[dim]
    if key.rsplit(".", 2)[-2] in VOCAB:
        rows = tp.vocab_rows(size)
        start = min(tp.rank * rows, size)
        part = view[start : min(start + rows, size)]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    if size % tp.world_size:
        raise ModelLoadError(f"{key}: engine.tensor_parallel={tp.world_size} does not divide its {size} rows/columns")
    n = size // tp.world_size
    return view[tp.rank * n : (tp.rank + 1) * n] if dim == 0 else view[:, tp.rank * n : (tp.rank + 1) * n]


def check_scale_blocks(name: str, module: nn.Module, block: tuple[int, int], tp: TensorParallel, where: str) -> None:
    """An FP8 checkpoint's matrix `name` (this rank's shard, `module`) must split on its scale-block boundaries:
    every rank's slice of its output rows (column-parallel) or input columns (row-parallel) a whole number of
    blocks. A ModelLoadError naming the matrix and the world size otherwise."""
    owner = name.rpartition(".")[0]
    parts = getattr(module, "parts", None)
    if parts:
        slices = [(f"{owner}.{part}", 0, rows) for part, rows in parts]
    elif name.rsplit(".", 1)[-1] in ROW:
        slices = [(name, 1, module.in_features)]
    else:
        return
    for matrix, dim, local in slices:
        if local % block[dim]:
            what = ("output rows", "input columns")[dim]
            raise ModelLoadError(
                f"{where}: {matrix} has {local * tp.world_size} {what}; engine.tensor_parallel={tp.world_size} gives "
                f"each rank {local}, which cuts its {block[0]}x{block[1]} FP8 scale blocks"
            )
