"""Moving data from the host to the device without making the host wait.

Index tables: a table that follows from host-known sizes (a mask plan's segment offsets, a
kernel's block list) is built once per plan on the host. A plain ``.to(device)`` from pageable memory blocks
the host (the driver stages it, and may synchronize the stream), so every upload goes through
pinned memory with ``non_blocking=True``: the copy is queued behind the work already on the
stream and the host runs on. The caching host allocator keeps the pinned block until the copy
has run. On the CPU the host tensor is the device tensor.

Both build under ``profiling.host_tables()``, so the op counter tells these tables from a stray
``torch.tensor`` in a step (``tests/test_nccl_rules.py``).

Large host buffers (offloaded residuals, local-step anchors): ``pin_memory=True`` takes them from
the caching host allocator, which rounds every block up to a power of two (a 7.3 GB residual
pins 8 GiB, and 5 GB pins 8 GiB). :func:`pinned_zeros` pins exactly what it allocates.
"""

from __future__ import annotations

import weakref

import torch

from .profiling import host_tables


def host_table(values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A table read on the host (a kernel launcher's arguments, never copied as it is)."""
    with host_tables():
        return torch.tensor(values, dtype=dtype)


def upload(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (a host tensor, or data ``torch.tensor`` takes) on ``device``, queued
    asynchronously from pinned memory."""
    with host_tables():
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _unregister(storage: torch.UntypedStorage) -> None:
    # the finalizer holds the storage until now: the memory outlives its registration
    torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())


def pinned_zeros(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A zeroed host tensor whose pages are locked (registered with CUDA) at exactly its size,
    or a plain host tensor when ``pin`` is false or there is no CUDA device."""
    host = torch.zeros(shape, dtype=dtype)
    if not (pin and torch.cuda.is_available() and host.numel()):
        return host
    err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(),
                                                   host.untyped_storage().nbytes(), 0))
    if err:
        raise RuntimeError(f"pinning {host.untyped_storage().nbytes()} bytes of host memory "
                           f"failed (cudaError {err}): lower the host memory the run asks for "
                           "(optimizer.offload_residuals=false) or raise the locked-memory limit "
                           "(ulimit -l)")
    weakref.finalize(host, _unregister, host.untyped_storage())
    return host
