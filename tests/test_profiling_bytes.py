"""``profiling.DeviceOpCounter``'s byte model per op kind: what the benchmarks' bytes per
parameter rest on."""

from __future__ import annotations

import torch

from scape_train.profiling import DeviceOpCounter


def _bytes(fn) -> int:
    with DeviceOpCounter() as ops:
        fn()
    return ops.bytes_moved


def test_each_op_kind_counts_what_it_reads_and_writes():
    x, y = torch.ones(1000), torch.ones(1000)
    idx = torch.arange(0, 1000, 10)
    assert _bytes(lambda: x.add(y)) == 3 * 4000               # two inputs, one output
    assert _bytes(lambda: x.mul_(2.0)) == 2 * 4000            # in place: read and written
    assert _bytes(lambda: torch._foreach_mul_([x, y], 0.5)) == 2 * 8000
    assert _bytes(lambda: x.zero_()) == 4000                  # written only
    assert _bytes(lambda: x.index_select(0, idx)) == 8 * 100 + 2 * 4 * 100   # touched ones
    # a new_* factory reads nothing of its template: only the result is written
    assert _bytes(lambda: x.new_zeros(0, dtype=torch.int64)) == 0
    assert _bytes(lambda: x.new_zeros(10)) == 40
