"""A Triton launch, counted by ``profiling.DeviceOpCounter`` like a dispatched op.

A Triton kernel never reaches torch's dispatcher, so the counters would not see it. The caller
computes the bytes the kernel reads and writes from its arguments (the same model of DRAM
traffic as the aten ops: each element read or written once, caches and atomics' reads ignored)
and :func:`launch` reports them, with one launch, to the counters in effect: ``profiling.active_counters``.

Under ``TRITON_INTERPRET=1`` the interpreter runs torch ops of its own around each launch
(copying the arguments to and from host storages); they are hidden from the counters, as a GPU
launch dispatches none -- so a no-host-read test on the CPU sees what a CUDA step would. This
module does not import triton: ``kernel`` is any ``@triton.jit`` function.
"""

from __future__ import annotations

from torch.utils._python_dispatch import _disable_current_modes

from ...profiling import active_counters


def count(name: str, nbytes: int) -> None:
    """One pass ``name`` moving ``nbytes``, reported to the active counters."""
    for counter in active_counters:
        counter.add_kernel(name, nbytes)


def launch(kernel, grid: tuple, name: str, nbytes: int, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, reported to the active counters as ``name``."""
    count(name, nbytes)
    run(kernel, grid, *args, **meta)


def run(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with the interpreter's own torch ops hidden, uncounted:
    for a caller that counts its bytes per pass (the fused step's passes)."""
    with _disable_current_modes():
        kernel[grid](*args, **meta)
