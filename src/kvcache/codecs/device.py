"""Which torch devices the TurboQuant pieces (rotation, codebook, QJL sketch, quantizer) are
built on, checked once when they are made so that a bad device fails there, typed.

Served: ``cpu`` and ``cuda`` (when this torch build and machine have it). The pieces use
float64, bfloat16, integer shifts and byte views of int32/int64 words, which those two
backends all have. ``meta`` is refused: encoding decides per vector from its values (which
rows to centre, norms that overflow float32), and a meta tensor has none.
"""

from __future__ import annotations

import torch

from kvcache.errors import InvalidArgumentError, InvalidConfigError, NotSupportedError

SERVED = ("cpu", "cuda")


def served_device(device: torch.device | str | None) -> torch.device:
    """``device`` (None: cpu) as a torch.device the pieces can live on, else a typed error:
    InvalidConfigError for a string torch cannot parse, NotSupportedError for a device type
    they do not serve or one this machine does not have."""
    if device is None:
        return torch.device("cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidConfigError("device", device, f"a torch.device of type {SERVED}") from e
    if d.type not in SERVED:
        raise NotSupportedError(f"device={str(d)!r}: the TurboQuant pieces run on {SERVED} only")
    if d.type == "cuda" and not _cuda_has(d):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise NotSupportedError(
            f"device={str(d)!r}: not available here (torch {torch.__version__} sees "
            f"{count} CUDA device(s))"
        )
    return d


def _cuda_has(d: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    return d.index is None or d.index < torch.cuda.device_count()


def require_on(x: torch.Tensor, device: torch.device, name: str) -> None:
    """InvalidArgumentError unless tensor ``x`` (argument ``name``) lives on ``device``."""
    if x.device != device:
        raise InvalidArgumentError(f"{name}.device", str(x.device), f"{device}")
