"""Programmatic dependent launch (PDL): a kernel launched while the previous one in the stream still runs, so the
launch gap and ramp-up hide behind the previous kernel's tail. Such a kernel starts once every program of the
previous one called `gdc_launch_dependents` (or exited) and must call `gdc_wait` before touching what earlier
kernels write; it loads what no kernel of a forward writes (weights) before that. CUDA graphs keep the edges.
Hopper (compute capability 9) or newer; never under Triton's interpreter.
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
