"""What the fused step's Triton passes read and write, counted, and the host tables they take.

A Triton launch never reaches torch's dispatcher, so ``profiling.DeviceOpCounter`` cannot see it:
each pass's bytes are computed from its arguments (:data:`TRAFFIC`, each element read or written
once) and reported to the counters in effect (``profiling.active_counters``) by :class:`Counted`.
"""

from __future__ import annotations

import ctypes

import torch

from ...host_to_device import host_table
from ...profiling import active_counters

def _i64s(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address)) if n else []


def _col_sum(tab: int, rows: int, width: int, col: int) -> int:
    return sum(_i64s(tab, rows * width)[col::width])


def bits_bytes(total: int) -> int:
    """Bytes of a decoded mask's packed bits (the Triton decode's): ``ceil(total / 8)`` padded to
    whole 16-byte words (the kernels' int32 view, aligned loads)."""
    return 16 * -(-total // 128)


ONE_BITS = 0x3F800000       # 1.0f: a parameter-table row's decay column for "no decay"


def _decayed(tab: int, rows: int, width: int, col: int) -> int:
    """Elements a parameter table's rows decay: their ranges ``[s0, s1)`` (columns ``col``,
    ``col + 1``) where the decay column (the next one) is not 1."""
    vals = _i64s(tab, rows * width)
    return sum(vals[q + col + 1] - vals[q + col] for q in range(0, len(vals), width)
               if vals[q + col + 2] != ONE_BITS)


# What each pass reads and writes, in bytes, from its arguments: the benchmarks'
# bytes-per-parameter figure counts the passes like the dispatched ops, by the elements each
# kernel touches.
TRAFFIC = {
    # g, e read, e written per element; at m's support idx, m, g, e read, e written
    "scape_prepare_replicated": lambda nt, grad_table, numels, e, m, pidx, kp, *_:
        12 * sum(_i64s(numels, nt)) + 24 * kp,
    "scape_prepare_replicated_general": lambda nt, grad_table, numels, *_: 16 * sum(_i64s(numels, nt)),
    # ... and on the own range ρ read, the candidate written; at m's support idx, m, ρ
    "scape_prepare_sharded": lambda nt, grad_table, numels, e, rho, m, pidx, kp, lo, hi, *_:
        12 * sum(_i64s(numels, nt)) + 8 * (hi - lo) + 16 * kp,
    # as the separate passes: the prepare, the payload and m gathered at M_t, m zeroed at its
    # old support
    "scape_prepare_gather": lambda total, g, e, m, pidx, kp, idx, k, *_:
        12 * total + 24 * kp + 24 * k + 12 * kp,
    # as the separate passes: the sharded prepare, the rows taken (idx, x read, the row and x
    # written), the owner's m and ρ gathered and ρ zeroed, m zeroed at its old support
    "scape_prepare_take": lambda total, g, x, rho, m, pidx, kp, lo, hi, cand, idx, k, rows,
        nrows, send, own_a, own_b, *_: 12 * total + 8 * (hi - lo) + 16 * kp + 20 * k
        + 24 * (own_b - own_a) + 12 * kp,
    "scape_gather": lambda k, *_: 16 * k,
    "scape_take": lambda k, *_: 20 * k,     # idx, src read, values and src written
    # the payload read, ĝ written; idx and m read (or the old m at the mask read from m_old,
    # where it was gathered); ρ read and zeroed; the old m at the mask written
    "scape_ghat": lambda k, idx, base, b, rho, m, m_old, *_: k * (
        8 + (8 if m is not None or rho is not None else 0) + (4 if m is not None else 0)
        + (8 if rho is not None else 0) + (4 if m_old is not None else 0)),
    # idx, ĝ and the old m read, θ read and written, m written; m zeroed at its old support (all
    # of m when unknown); the weight decay over the segments' other elements (θ read and
    # written; counted as its own stream)
    "scape_adams": lambda idx, j0, k, base, ghat, m, mlen, z, n_zero, param_table, nseg, out, *_:
        28 * k + (4 * mlen if n_zero < 0 else 12 * n_zero)
        + (0 if out is not None else 8 * _decayed(param_table, nseg, 7, 4)),
    # the scratch bitmap zeroed, b's indices read and their bytes written (unless b is NULL:
    # the bits given), a's read and their bytes read
    "scape_count_common": lambda a, na, b, nb, bits, nbytes:
        (nbytes + 9 * nb if b is not None else 0) + 9 * na,
    "scape_scatter_params": lambda idx, scatter_table, nseg, v:
        16 * (_col_sum(scatter_table, nseg, 8, 3) - _col_sum(scatter_table, nseg, 8, 2))
        + 8 * _decayed(scatter_table, nseg, 8, 5),
}


class Counted:
    """A passes library (:class:`.triton_passes.TritonPasses`), each call counted as one
    launch by the active ``DeviceOpCounter`` s."""

    def __init__(self, passes):
        self._passes = passes

    def __getattr__(self, name: str):
        fn, traffic = getattr(self._passes, name), TRAFFIC[name]

        def call(*args):
            if active_counters:
                nbytes = traffic(*args)
                for c in active_counters:
                    c.add_kernel(name, nbytes)
            return fn(*args)

        setattr(self, name, call)
        return call


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a pass (``None`` -> NULL); it must be contiguous."""
    if t is None:
        return None
    assert t.is_contiguous(), "the passes take contiguous tensors"
    return t.data_ptr()


def table(rows: list[list[int]], width: int) -> torch.Tensor:
    """An int64 table of ``width`` columns (kept alive by the caller across the call)."""
    return host_table(rows).reshape(-1, width) if rows else \
        torch.zeros(0, width, dtype=torch.int64)
