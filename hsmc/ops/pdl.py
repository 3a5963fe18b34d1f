"""Programmatic dependent launch (PDL): a kernel launched while the previous one in the stream still runs.

A kernel launched with `launch_pdl` starts as soon as every program of the previous kernel has called
`gdc_launch_dependents` (or exited); it must call `gdc_wait` before it reads what earlier kernels wrote or
writes anything they might still read. Kernels of a one-row forward (`decode_linear`, RoPE + KV write,
paged attention) do both at their start, after loading whatever no kernel of a forward writes (weights).
CUDA graphs keep the launches' programmatic edges. Hopper (compute capability 9) or newer; never under
Triton's interpreter.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def pdl_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords of a kernel with a `USE_PDL` constexpr on `device`."""
    use = pdl_supported(device)
    return {"USE_PDL": use, "launch_pdl": True} if use else {"USE_PDL": False}
