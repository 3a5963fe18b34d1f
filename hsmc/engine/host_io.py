"""Host <-> device copies that never stall the stream.

Uploads (prompts, row lists built on the host) go through pinned memory with `non_blocking=True`;
the one planned read of a decode step (its new tokens and counts) is copied into pinned memory
behind an event, so the host can enqueue the next step before it waits for this one (overlap).
On the CPU both are plain tensors and the read is a `.tolist()`.
"""

from __future__ import annotations

import torch


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied asynchronously from pinned memory on CUDA."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


class PendingRead:
    """Device tensors on their way to the host in ONE copy; `result()` waits for it and returns them as lists.

    Several tensors are packed into one float64 buffer (exact for token ids and counts), so a cycle that
    needs tokens, flags and statistics still synchronizes once."""

    def __init__(self, *values: torch.Tensor) -> None:
        self.shapes = [v.shape for v in values]
        value = values[0] if len(values) == 1 else torch.cat([v.double().reshape(-1) for v in values])
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event: torch.cuda.Event | None = torch.cuda.Event()
            self.event.record()
        else:  # a copy: a graph's output (its static tensor) changes at the next replay, launched before this read
            self.host, self.event = value.clone(), None

    def result(self) -> list:
        """One tensor: its values as (nested) lists; several: a list of them, one per tensor."""
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()  # one conversion: the pinned buffer is already on the host
        if len(self.shapes) == 1:
            return values
        parts, start = [], 0
        for shape in self.shapes:
            size = shape.numel()
            flat, start = values[start : start + size], start + size
            parts.append(_nest(flat, tuple(shape)))
        return parts


def _nest(flat: list, shape: tuple[int, ...]) -> list:
    """A flat list as nested lists of `shape` (a scalar shape gives the value itself)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def read_counters(*counters: torch.Tensor) -> list[float]:
    """Statistics kept on the device (scalars or vectors) read in one copy, at the end of a run."""
    return PendingRead(torch.stack([c.double() for c in counters])).result()
