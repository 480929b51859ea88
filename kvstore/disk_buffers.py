"""Payload buffers for the SSD tier: bytes-like data and uint8 tensors as flat byte views.

Contract: bytes-like data (numpy arrays included) and contiguous CPU uint8 tensors are viewed in
place, so writing into the view writes into them; a device or non-contiguous uint8 tensor is
copied first (as ``.cpu().contiguous()`` does); anything else is a ``TypeError``.
"""

from __future__ import annotations

from typing import Any


def as_byte_view(payload: Any) -> memoryview:
    """A flat byte view of bytes-like data (numpy arrays included) or a uint8 tensor (on the
    CPU), without copying."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        if type(payload).__module__ == "numpy":
            return memoryview(payload).cast("B")
        import torch  # only callers that pass tensors pay for the import

        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise TypeError(f"a disk block payload is bytes or a uint8 tensor, got {payload!r:.80}")
        payload = payload.detach().cpu().contiguous().view(-1).numpy()
    return memoryview(payload).cast("B")
