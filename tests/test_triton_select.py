"""The next mask's Triton top-k (``optim/scape/triton_select.py``), interpreted on the CPU (the
conftest sets TRITON_INTERPRET=1), against the torch path's per-segment top-k of the same keys
(``kernels.topk_segments``): equal masks, planted ties included; with ties exactly k ones per
segment, every chosen |c| >= every unchosen one, and among equal values the lowest indices (also
where the tied elements overflow a segment's buffer); a fixed number of launches whatever the
number of segments; no host reads.
"""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.scape.kernels import topk_segments
from scape_train.optim.scape.masks import own_segments, topk_own_mask
from scape_train.optim.scape.partition import build_partition
from scape_train.optim.scape.strategy import select_passes
from scape_train.profiling import DeviceOpCounter

from .test_wire_units import odd_model
from .test_scape_units import layout_of

pytest.importorskip("triton")

from scape_train.optim.scape import triton_select as TS  # noqa: E402

CPU = torch.device("cpu")
TRITON = select_passes("on", CPU)

# (start, numel, k): one block and several (BLOCK = 8192), k of 1 and of most of a segment,
# an all-ones segment, a segment of one element
SEGMENTS = ((0, 5000, 50), (5000, 64, 64), (5064, 20000, 3), (25064, 9000, 4500),
            (34064, 17, 1), (34081, 1, 1), (34082, 40000, 400))
TOTAL = 74082


def _select(stat: torch.Tensor, segments=SEGMENTS) -> torch.Tensor:
    return TRITON.topk_mask(stat, segments)


def _check_ties(stat: torch.Tensor, bits: torch.Tensor, segments=SEGMENTS) -> None:
    """k ones per segment, chosen |c| >= unchosen |c|, and at the threshold the lowest
    indices of the tied values (the select's rule)."""
    for a, n, k in segments:
        x, m = stat[a:a + n].abs(), bits[a:a + n]
        assert int(m.sum()) == k, (a, n, k)
        if k == n:
            continue
        t = x[m].min()
        assert t >= x[~m].max(), (a, n, k)
        tied = x == t
        need = k - int((x > t).sum())
        assert torch.equal(m, (x > t) | (tied & (tied.cumsum(0) <= need))), (a, n, k)


@pytest.mark.parametrize("seed", [0, 1])
def test_masks_equal_torch_topk_without_ties(seed):
    stat = torch.randn(TOTAL, generator=torch.Generator().manual_seed(seed))
    got = _select(stat)
    assert got.dtype == torch.bool and got.shape == (TOTAL,)
    assert torch.equal(got, topk_segments(stat, SEGMENTS))


def test_planted_ties_exact_k_and_lowest_indices_first():
    """Few distinct values: the ties straddle every threshold. Segments whose tied values do
    not fit their buffer (2k + 1024 slots) take the in-place path: the same rule."""
    gen = torch.Generator().manual_seed(3)
    stat = torch.randint(-3, 4, (TOTAL,), generator=gen).float()
    stat[5064:25064] = 0.0              # a segment of zeros (and -0.0): all tied
    stat[5064:25064:7] = -0.0
    got = _select(stat)
    _check_ties(stat, got)
    torch_bits = topk_segments(stat, SEGMENTS)
    _check_ties(stat, torch_bits)
    assert torch.equal(got, torch_bits)


def test_extreme_values_order_as_their_magnitude():
    """Infinities, subnormals, signed zeros and huge values order by |c|, NaN above inf, on
    both paths alike."""
    gen = torch.Generator().manual_seed(4)
    stat = torch.randn(TOTAL, generator=gen) * 1e-40        # subnormal
    stat[::97] = torch.randn(stat[::97].shape, generator=gen) * 1e30
    stat[10::1001] = float("-inf")
    stat[11::1003] = float("inf")
    got = _select(stat)
    _check_ties(stat, got)
    assert torch.equal(got, topk_segments(stat, SEGMENTS))
    stat[12::89] = float("nan")
    stat[13::91] = -float("nan")
    got = _select(stat)
    nan = stat.isnan()
    for a, n, k in SEGMENTS:      # the NaNs first, the lowest indices first among them
        x, m = nan[a:a + n], got[a:a + n]
        first = x & (x.cumsum(0) <= k)
        assert torch.equal(m & first, first), (a, n, k)
    assert torch.equal(got, topk_segments(stat, SEGMENTS))


def test_model_segments_through_topk_own_mask():
    """A model's owner segments (excluded tensors all ones) at several world sizes: the
    Triton passes' mask equals the torch one's."""
    lay = layout_of(odd_model())
    for world in (1, 2):
        part = build_partition(lay, world, "flat")
        for rank in range(world):
            lo, hi = part.ranges[rank]
            stat = torch.randn(hi - lo, generator=torch.Generator().manual_seed(rank))
            got = topk_own_mask(stat, part, rank, lay, 0.1, TRITON)
            want = topk_own_mask(stat, part, rank, lay, 0.1)
            assert torch.equal(got, want), (world, rank)
            assert own_segments(part, rank, lay, 0.1) == tuple(
                (s.flat_start - lo, s.numel, s.numel if lay.excluded[s.tensor]
                 else max(1, int(0.1 * s.numel))) for s in part.segments[rank])


def test_a_fixed_number_of_launches_and_no_host_reads():
    """Nine kernels and one zero fill for any number of segments; nothing read back."""
    stat = torch.randn(TOTAL, generator=torch.Generator().manual_seed(5))
    many = tuple((a, 50, 5) for a in range(0, 5000, 50))
    for segments in (SEGMENTS, many):
        _select(stat, segments)               # tables built and uploaded once per list
        with DeviceOpCounter() as ops:
            _select(stat, segments)
        assert ops.host_syncs == 0, ops.sync_sites
        assert ops.launches == 1 + 4 + len(TS.LEVELS) - 1, ops.ops
        assert sum(v for k, v in ops.ops.items() if k.startswith("triton::")) == 9


def test_a_segment_too_long_for_the_index_field_is_refused():
    with pytest.raises(ValueError, match="use_triton=off"):
        TS.SelectPlan([(0, 1 << 31, 10)], CPU)
