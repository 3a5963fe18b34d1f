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
    """A device tensor on its way to the host; `result()` waits for it and returns it as lists."""

    def __init__(self, value: torch.Tensor) -> None:
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event: torch.cuda.Event | None = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = value, None

    def result(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def read_counters(*counters: torch.Tensor) -> list[float]:
    """Several device scalars (statistics kept on the device) read in one copy, at the end of a run."""
    return PendingRead(torch.stack([c.double() for c in counters])).result()
