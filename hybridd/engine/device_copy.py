"""Host tensors to the device without a host wait: a pageable host-to-device copy waits
for the device's stream (the host stalls until every step queued before it has run), a
copy from pinned memory is queued like a kernel."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`: through pinned memory on CUDA, itself elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
