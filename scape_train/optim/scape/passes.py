"""The one seam of the fused step's passes: which library runs them, chosen by device.

:mod:`.triton_passes` where :func:`kernels.resolve_backend` picks Triton (CUDA tensors with
triton importable, ``optimizer.use_triton: auto``; or ``use_triton: on``, which on CPU tensors
needs ``TRITON_INTERPRET=1``, how the kernels are tested without a GPU); ``None`` otherwise: the
fused engine runs its torch ops, also the reference the kernels are tested against. The library
returns its sums as device tensors and takes the clipping coefficient as one, so the step never
reads a value back to the host; its calls are counted (:class:`.traffic.Counted`).
"""

from __future__ import annotations

import torch

from .kernels import resolve_backend
from .traffic import Counted

_triton_libs: dict[str, Counted] = {}


def lib(backend: str, *tensors: torch.Tensor) -> Counted | None:
    """The passes library for ``tensors`` under ``backend`` (``auto``/``torch``/``triton``)."""
    if not tensors or resolve_backend(backend, *tensors) != "triton":
        return None
    key = str(tensors[0].device)
    if key not in _triton_libs:
        from .triton_passes import TritonPasses   # imports triton: only when chosen

        _triton_libs[key] = Counted(TritonPasses(tensors[0].device))
    return _triton_libs[key]
