"""The mask codings' Triton kernels (``optim/scape/triton_codecs.py``), interpreted on the CPU
(the conftest sets TRITON_INTERPRET=1), against the torch path they stand in for: byte for byte
(encode) and mask plus sorted indices (decode), every coding, world sizes 1-3, implicit all-ones
segments, segments of several blocks; no host reads; the bytes each launch reports. (The payload
codec is torch ops on every device: tests/test_wire_units.py.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from scape_train.comm import Comm
from scape_train.optim.scape import kernels
from scape_train.optim.scape.mask_format import bits_bytes
from scape_train.optim.scape import mask_coding as MC
from scape_train.optim.scape import mask_format as MF
from scape_train.optim.scape.masks import Mask, MaskExchange, mask_counts
from scape_train.optim.scape.strategy import select_passes
from scape_train.optim.scape.torch_passes import TorchPasses
from scape_train.optim.scape.partition import ParamLayout, build_partition
from scape_train.profiling import DeviceOpCounter

from .test_wire_units import _owners_bits, odd_model

pytest.importorskip("triton")

from scape_train.optim.scape import triton_codecs as TC  # noqa: E402

CPU = torch.device("cpu")
TRITON, TORCH = select_passes("on", CPU), TorchPasses()


# -- mask codings ---------------------------------------------------------------------------------

def _check_plan(plan: MC.MaskPlan, own: list[torch.Tensor]) -> None:
    """Triton encode == torch encode; Triton decode == the owners' bits (and the torch
    decode's), its indices == nonzero of them."""
    world = len(own)
    shards = []
    for r in range(world):
        got = plan.encode(own[r], r, TRITON)
        assert torch.equal(got, plan.encode(own[r], r, TORCH)), r
        shards.append(got)
    gathered = torch.cat(shards) if plan.shard_bytes else None
    mask, idx, bits = plan.decode(gathered, CPU, TRITON)
    want = torch.cat(own)
    if plan.legacy:          # the whole-range bitmap: no per-segment counts, no indices
        assert torch.equal(mask, want) and idx is None and bits is None
        return
    assert mask is None                                   # the step's decode: no mask written
    assert torch.equal(idx, torch.nonzero(want).view(-1))
    packed = kernels.pack_bits(want)                      # but the mask's packed bits
    assert torch.equal(bits[:packed.numel()], packed) and not bits[packed.numel():].any()
    assert torch.equal(Mask(plan.total, indices=idx, bits=bits).dense(), want)
    t_mask, t_idx, _ = plan.decode(gathered, CPU, TORCH)
    assert torch.equal(Mask(plan.total, dense=t_mask, indices=t_idx).dense(), want)
    assert t_idx is None or torch.equal(t_idx, idx)


@pytest.mark.parametrize("coding", ["auto", "bitmap", "indices", "elias_fano"])
@pytest.mark.parametrize("world,partitioner", [(1, "flat"), (2, "tensor"), (3, "flat")])
def test_mask_codings_match_the_torch_path(coding, world, partitioner):
    """Odd tensor sizes, biases and a norm gain (excluded: implicit all-ones segments), uneven
    owner ranges, segments at odd flat and byte offsets."""
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, world, partitioner)
    for seed, density in enumerate([0.01, 0.1, 0.5, 1.0]):
        own = _owners_bits(lay, part, density, seed)
        counts = [] if coding == "bitmap" else mask_counts(part, lay, density)
        _check_plan(MC.MaskPlan(part, lay, counts, coding, lay.total), own)


def _one_segment_plan(numel: int, kind: str, k: int, width: int | None = None):
    """A plan of a 13-element excluded gain (all ones) and one ``numel``-element segment coded
    ``kind`` (``width``: a wider index field than it needs, to write fields of every width)."""
    model = nn.Module()
    model.gain = nn.Parameter(torch.ones(13))
    model.weight = nn.Parameter(torch.randn(1, numel))
    lay = ParamLayout(model, weight_decay=0.0, exclude_norm_bias=True)
    part = build_partition(lay, 1, "flat")
    plan = MC.MaskPlan(part, lay, [[13, k]], "auto", lay.total)
    seg = MF.seg_code(kind, 13, numel, k, 0)
    if width is not None:
        seg = MF.SegCode(MF.INDICES, 13, numel, k, width, 0, kernels.packed_numel(k * width), 0)
    plan.segs[0][1] = seg
    plan.rank_bytes = [seg.nbytes]
    plan.shard_bytes = seg.nbytes
    plan.cache = {}
    return plan


def _bits_with(numel: int, k: int, where: str, g: torch.Generator) -> torch.Tensor:
    bits = torch.zeros(numel, dtype=torch.bool)
    if where == "random":
        bits[torch.randperm(numel, generator=g)[:k]] = True
    elif where == "first":
        bits[:k] = True
    else:
        bits[numel - k:] = True
    return bits


@pytest.mark.parametrize("numel", [2, 9, 65, 10_000])
def test_every_segment_coding_and_k_across_blocks(numel):
    """Each coding forced on one segment, k from 1 to numel - 1; 10 000 elements span three
    scan blocks (and the Elias-Fano upper vector of k = 6000 more than one)."""
    g = torch.Generator().manual_seed(numel)
    ks = sorted(k for k in {1, 2, numel // 3, numel // 2, numel - 1, 6000} if 0 < k < numel)
    for kind, k in itertools.product([MF.BITMAP, MF.INDICES, MF.ELIAS_FANO], ks):
        for where in ("random", "first", "last"):
            bits = torch.cat([torch.ones(13, dtype=torch.bool), _bits_with(numel, k, where, g)])
            _check_plan(_one_segment_plan(numel, kind, k), [bits])


def test_index_fields_of_every_width_at_every_bit_offset():
    """Fields of 1..33 bits (the widest a segment may use) written and read at every offset
    inside a byte and a 32-bit word: k consecutive fields start at every k·w mod 32."""
    g = torch.Generator().manual_seed(0)
    for width in range(1, 34):
        numel = min(1 << width, 700)
        k = min(37, numel - 1)
        bits = torch.cat([torch.ones(13, dtype=torch.bool), _bits_with(numel, k, "random", g)])
        _check_plan(_one_segment_plan(numel, MF.INDICES, k, width=width), [bits])


# -- no host reads, and the bytes each launch reports ---------------------------------------------

def test_the_triton_path_reads_nothing_back():
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, 1, "flat")
    ex = MaskExchange(part, Comm(), lay.total, TRITON, layout=lay, coding="auto")
    bits = _owners_bits(lay, part, 0.05, 3)[0]
    ex.start(bits, 0.05).wait()                                 # builds the plan's tables
    with DeviceOpCounter() as ops:
        got = ex.start(bits, 0.05).wait()
    assert dict(ops.sync_sites) == {}
    assert torch.equal(got, bits)
    assert {"triton::mask_encode_fields", "triton::mask_decode_scan"} <= set(ops.ops)


def _tasks(numels, step: int) -> int:
    return sum(-(-n // step) for n in numels)


def _encode_bytes(segs: list[MF.SegCode]) -> dict[str, int]:
    """What an owner's encode launches move, from its segments (triton_codecs' byte model)."""
    row = 8 * len(TC._COLUMNS)                                  # bytes of one task row
    pack = [s for s in segs if s.kind == MF.BITMAP]
    coded = [s for s in segs if s.kind in (MF.INDICES, MF.ELIAS_FANO) and s.k]
    nb = _tasks([s.numel for s in pack], 8 * TC.PACK_BYTES)
    nf = _tasks([s.numel for s in coded], TC.BLOCK)
    return {"mask_encode_bitmap": nb * row + sum(s.numel + s.high_bytes for s in pack),
            "mask_encode_count": nf * row + sum(s.numel for s in coded) + 8 * nf,
            "mask_encode_fields": nf * row + sum(s.numel + s.nbytes for s in coded) + 16 * nf}


def _coded_plan() -> tuple[MC.MaskPlan, list[torch.Tensor]]:
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, 2, "flat")
    plan = MC.MaskPlan(part, lay, mask_counts(part, lay, 0.1), "auto", lay.total)
    assert {MF.BITMAP, MF.ELIAS_FANO, MF.ALL} <= set(plan.kinds())
    return plan, _owners_bits(lay, part, 0.1, 0)


def test_counted_encode_bytes_follow_the_plan():
    plan, own = _coded_plan()
    with DeviceOpCounter() as ops:
        for r in range(2):
            plan.encode(own[r], r, TRITON)
    want: dict[str, int] = {}
    for codes in plan.segs:
        for name, nbytes in _encode_bytes(codes).items():
            want[name] = want.get(name, 0) + nbytes
    assert dict(ops.kernel_bytes) == {k: v for k, v in want.items() if v}


def test_counted_decode_bytes_follow_the_plan():
    plan, own = _coded_plan()
    gathered = torch.cat([plan.encode(own[r], r, TRITON) for r in range(2)])
    row = 8 * len(TC._COLUMNS)
    flat = [s for codes in plan.segs for s in codes]
    scanned = [s for s in flat if s.kind in (MF.BITMAP, MF.ELIAS_FANO)]
    listed = [s for s in flat if s.kind in (MF.ALL, MF.INDICES)]
    ns = (_tasks([s.numel for s in flat if s.kind == MF.BITMAP], TC.BLOCK)
          + _tasks([8 * s.high_bytes for s in flat if s.kind == MF.ELIAS_FANO], TC.BLOCK))
    nd = _tasks([s.numel if s.kind == MF.ALL else s.k for s in listed], TC.BLOCK)
    plan.decode(gathered, CPU, TRITON)              # builds the plan's task tables
    with DeviceOpCounter() as ops:
        _, idx, bits = plan.decode(gathered, CPU, TRITON)
    # per one: its 8-byte index written, and its bit ORed into an int32 word (4 B)
    assert dict(ops.kernel_bytes) == {
        "mask_decode_count": ns * row + sum(s.high_bytes for s in scanned) + 8 * ns,
        "mask_decode_scan": ns * row + 16 * ns + sum(s.high_bytes + s.low_bytes + 12 * s.k
                                                     for s in scanned),
        "mask_decode_direct": nd * row + sum(s.low_bytes + 12 * (s.numel if s.kind == MF.ALL
                                                                 else s.k) for s in listed)}
    # dispatched ops: the block starts' scan, the index vector, the bits' zero fill (1/8 byte per
    # element, not the byte per element of a bool mask)
    assert ops.bytes_moved - sum(ops.kernel_bytes.values()) < plan.total // 2
    assert bits.numel() == bits_bytes(plan.total) and bits.numel() % 16 == 0
    assert ops.ops["triton::mask_decode_scan"] == 1
