"""The one seam of the fused step's passes: which library runs them, chosen by device.

- **Triton** (:mod:`.triton_passes`) where :func:`kernels.resolve_backend` picks Triton: CUDA
  tensors with triton importable (``optimizer.use_triton: auto``), or ``use_triton: on``, which on
  CPU tensors needs ``TRITON_INTERPRET=1`` (how the kernels are tested without a GPU);
- **C loops** (:mod:`.native`) on the CPU otherwise;
- ``None``: the fused engine runs its torch ops (``SCAPE_NATIVE=0`` or no C compiler on the CPU;
  ``SCAPE_KERNEL_BACKEND=torch`` or ``use_triton: off`` on CUDA), also the reference both
  libraries are tested against.

Both libraries have the same functions and arguments (``native/scape_cpu.c``'s); a library with
``on_device`` returns its sums as device tensors and takes the clipping coefficient as one, so
the step never reads a value back to the host there. Both are counted by ``DeviceOpCounter``
through ``native._TRAFFIC``.
"""

from __future__ import annotations

import torch

from . import native
from .kernels import resolve_backend

_triton_libs: dict[str, object] = {}


def lib(backend: str, *tensors: torch.Tensor):
    """The passes library for ``tensors`` under ``backend`` (``auto``/``torch``/``triton``)."""
    if tensors and resolve_backend(backend, *tensors) == "triton":
        device = tensors[0].device
        key = str(device)
        if key not in _triton_libs:
            from .triton_passes import TritonPasses   # imports triton: only when chosen

            _triton_libs[key] = native.counted(TritonPasses(device))
        return _triton_libs[key]
    return native.lib(*tensors)
