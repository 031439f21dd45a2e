"""The Triton wire-format kernels (``optim/scape/triton_codecs.py``, ``triton_payload.py``),
interpreted on the CPU (the conftest sets TRITON_INTERPRET=1), against the paths they stand in
for: the mask codings byte for byte against the torch path and the C path (encode) and mask plus
sorted indices (decode), every coding, world sizes 1-3, implicit all-ones segments, segments of
several blocks; the payload codec bit for bit against the torch codec, and each integer
conversion against torch's own casts on every fp8 code's neighbourhood, ties, subnormals, random
bit patterns and NaN; no host reads; the bytes each launch reports.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from scape_train.comm import Comm
from scape_train.optim.scape import kernels, traffic
from scape_train.optim.scape import mask_coding as MC
from scape_train.optim.scape import mask_format as MF
from scape_train.optim.scape.masks import MaskExchange, mask_counts
from scape_train.optim.scape.partition import ParamLayout, build_partition
from scape_train.optim.scape.payload import SCALE_BLOCK, PayloadCodec
from scape_train.profiling import DeviceOpCounter

from .test_wire_units import _owners_bits, _spread, odd_model

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from scape_train.optim.scape import triton_codecs as TC  # noqa: E402
from scape_train.optim.scape import triton_payload as TP  # noqa: E402

CPU = torch.device("cpu")
LOWP = ["bf16", "fp8_e4m3", "fp8_e5m2"]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# -- mask codings ---------------------------------------------------------------------------------

def _check_plan(plan: MC.MaskPlan, own: list[torch.Tensor]) -> None:
    """Triton encode == torch encode; Triton decode == the owners' bits (and the torch
    decode's), its indices == nonzero of them."""
    world = len(own)
    shards = []
    for r in range(world):
        got = plan.encode(own[r], r, "triton")
        assert torch.equal(got, plan.encode(own[r], r, "torch")), r
        shards.append(got)
    gathered = torch.cat(shards) if plan.shard_bytes else None
    mask, idx = plan.decode_with_indices(gathered, CPU, "triton")
    want = torch.cat(own)
    assert torch.equal(mask, want)
    if plan.legacy:          # the whole-range bitmap: no per-segment counts, no indices
        assert idx is None
        return
    assert torch.equal(idx, torch.nonzero(want).view(-1))
    none, lean = plan.decode_with_indices(gathered, CPU, "triton", with_mask=False)
    assert none is None and torch.equal(lean, idx)        # the step's decode: no mask written
    _, _, bits = plan.decode_parts(gathered, CPU, "triton")   # but the mask's packed bits
    packed = kernels.pack_bits(want, backend="torch")
    assert torch.equal(bits[:packed.numel()], packed) and not bits[packed.numel():].any()
    t_mask, t_idx = plan.decode_with_indices(gathered, CPU, "torch")
    assert torch.equal(t_mask, want)
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
        seg = MC.SegCode(MC.INDICES, 13, numel, k, width, 0, kernels.packed_numel(k * width), 0)
    plan.segs[0][1] = seg
    plan.rank_bytes = [seg.nbytes]
    plan.shard_bytes = seg.nbytes
    plan._tables = {}
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
    for kind, k in itertools.product([MC.BITMAP, MC.INDICES, MC.ELIAS_FANO], ks):
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
        _check_plan(_one_segment_plan(numel, MC.INDICES, k, width=width), [bits])


# -- payload codec --------------------------------------------------------------------------------

def _special(n: int) -> torch.Tensor:
    """Zeros of both signs, subnormals, the fp32 extremes, values that cross a block's scale."""
    vals = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1.17e-38, 3.4e38, -3.4e38, 1.0, -1.0,
                         2.0 ** -126, 448.0, 57344.0, 2.0 ** 100, 2.0 ** -100])
    return vals.repeat(-(-n // vals.numel()))[:n]


@pytest.mark.parametrize("name", LOWP)
@pytest.mark.parametrize("n", [0, 1, 5, 127, 128, 129, 1000, 3 * SCALE_BLOCK + 5,
                               2 * TP.SCALE_GROUPS * SCALE_BLOCK + 5])    # 3 programs per row
def test_payload_codec_matches_the_torch_codec(name, n):
    ref, fast = PayloadCodec(name, "torch"), PayloadCodec(name, "triton")
    for rows in (1, 3):
        x = torch.stack([_spread(n, s) for s in range(rows - 1)] + [_special(n)])
        if n > 2 * SCALE_BLOCK:
            x[:, SCALE_BLOCK:2 * SCALE_BLOCK] = 0.0                    # an all-zero block
            x[:, 2 * SCALE_BLOCK:] *= 2.0 ** -140                      # a subnormal block
        wire = fast.encode(x)
        assert torch.equal(wire, ref.encode(x)), (name, n, rows)
        if n == 0:           # (the torch codec cannot view 0 bytes of a row as bf16)
            assert fast.decode(wire, 0).shape == (rows, 0)
            continue
        assert torch.equal(_bits(fast.decode(wire, n)), _bits(ref.decode(wire, n)))
        strided = torch.cat([wire, wire], dim=1)[:, :wire.shape[1]]   # rows of a larger buffer
        assert torch.equal(_bits(fast.decode(strided, n)), _bits(ref.decode(wire, n)))


@triton.jit
def _convert_kernel(x_ptr, k_ptr, out_ptr, n, OP: tl.constexpr, MBITS: tl.constexpr,
                    BIAS: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0)
    if OP == 0:
        y = TP._fp32_to_fp8(x, MBITS, BIAS, SATURATE)
    elif OP == 1:
        y = TP._fp8_to_fp32(x, MBITS, BIAS, SATURATE)
    elif OP == 2:
        y = TP._fp32_to_bf16(x)
    else:
        y = TP._mul_pow2(x, tl.load(k_ptr + offs, mask=m, other=0))
    tl.store(out_ptr + offs, y, mask=m)


def _convert(op: int, x: torch.Tensor, name: str = "fp8_e4m3", k: torch.Tensor | None = None):
    x = x.contiguous()
    out = torch.empty_like(x)
    k = x if k is None else k
    _convert_kernel[(triton.cdiv(x.numel(), 8192),)](x, k, out, x.numel(), OP=op,
                                                     **TP._FP8[name], BLOCK=8192)
    return out


def _neighbourhoods(dtype: torch.dtype) -> torch.Tensor:
    """Every finite code's value, the midpoints between neighbouring codes (the ties), and the
    fp32s one and two ulps either side of both, with both signs; overflow and the specials."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique()
    mids = (v[1:] + v[:-1]) / 2                                  # exact in fp32
    centres = _bits(torch.cat([v, mids, v[-1:] * 1.1, v[-1:] * 2]))
    near = torch.cat([centres + d for d in (-2, -1, 0, 1, 2)]).clamp_(min=0)
    specials = torch.tensor([0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x00000001,
                             0x007FFFFF, 0x00800000, 0x7F7FFFFF], dtype=torch.int32)
    mag = torch.cat([near, specials])
    return torch.cat([mag, mag | torch.tensor(-2 ** 31, dtype=torch.int32)])


def _random_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp32_to_fp8_is_torchs_cast(name):
    dt = FP8[name]
    small = _bits(torch.randn(50_000, generator=torch.Generator().manual_seed(1))
                  * torch.exp2(torch.randint(-30, 20, (50_000,), dtype=torch.float32)))
    x = torch.cat([_neighbourhoods(dt), _random_bits(50_000, 2), small])
    want = x.view(torch.float32).to(dt).view(torch.uint8).to(torch.int32)
    got = _convert(0, x, name)
    bad = (got != want).nonzero().view(-1)[:5]
    assert bad.numel() == 0, [(hex(int(x[i]) & 0xFFFFFFFF), int(got[i]), int(want[i]))
                              for i in bad]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_to_fp32_is_torchs_cast_on_every_code(name):
    codes = torch.arange(256, dtype=torch.int32)
    want = _bits(codes.to(torch.uint8).view(FP8[name]).float())
    assert torch.equal(_convert(1, codes, name), want)          # NaN bit patterns included


def test_fp32_to_bf16_and_back_are_torchs_casts():
    ties = _random_bits(20_000, 3) & ~0xFFFF | 0x8000           # exactly halfway, odd and even
    x = torch.cat([_random_bits(100_000, 4), ties, ties + 1, ties - 1,
                   _neighbourhoods(torch.float8_e5m2)])
    want = x.view(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(_convert(2, x), want)
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    back = PayloadCodec("bf16", "triton").decode(codes.view(torch.uint8).view(1, -1), 1 << 16)
    assert torch.equal(_bits(back), _bits(codes.view(torch.bfloat16).float().view(1, -1)))


def test_scaling_by_a_power_of_two_is_the_ieee_product():
    """Subnormal inputs and products (rounded to nearest even), overflow to inf, 0, inf, NaN."""
    n = 60_000
    g = torch.Generator().manual_seed(5)
    x = torch.cat([_random_bits(n, 6), _random_bits(n, 7) & 0x80FFFFFF,       # tiny exponents
                   _neighbourhoods(torch.float8_e4m3fn)])
    k = torch.randint(-126, 128, (x.numel(),), generator=g, dtype=torch.int32)
    want = _bits(x.view(torch.float32) * torch.exp2(k.float()))
    got = _convert(3, x, k=k)
    nan = torch.isnan(want.view(torch.float32))
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan], want[nan])                     # quieted, payload kept


# -- no host reads, and the bytes each launch reports ---------------------------------------------

def test_the_triton_path_reads_nothing_back():
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, 1, "flat")
    ex = MaskExchange(part, Comm(), lay.total, "triton", layout=lay, coding="auto")
    bits = _owners_bits(lay, part, 0.05, 3)[0]
    codec = PayloadCodec("fp8_e4m3", "triton")
    x = _spread(1000, 0).view(1, -1)
    ex.start(bits, 0.05).wait()                                 # builds the plan's tables
    with DeviceOpCounter() as ops:
        got = ex.start(bits, 0.05).wait()
        d = codec.decode(codec.encode(x), x.shape[1])
    assert dict(ops.sync_sites) == {}
    assert torch.equal(got, bits)
    assert torch.equal(d, PayloadCodec("fp8_e4m3", "torch").round_trip(x)[1])
    assert {"triton::mask_encode_fields", "triton::mask_decode_scan",
            "triton::payload_encode_fp8_e4m3"} <= set(ops.ops)


def _tasks(numels, step: int) -> int:
    return sum(-(-n // step) for n in numels)


def _encode_bytes(segs: list[MC.SegCode]) -> dict[str, int]:
    """What an owner's encode launches move, from its segments (triton_codecs' byte model)."""
    row = 8 * len(TC._COLUMNS)                                  # bytes of one task row
    pack = [s for s in segs if s.kind == MC.BITMAP]
    coded = [s for s in segs if s.kind in (MC.INDICES, MC.ELIAS_FANO) and s.k]
    nb = _tasks([s.numel for s in pack], 8 * TC.PACK_BYTES)
    nf = _tasks([s.numel for s in coded], TC.BLOCK)
    return {"mask_encode_bitmap": nb * row + sum(s.numel + s.high_bytes for s in pack),
            "mask_encode_count": nf * row + sum(s.numel for s in coded) + 8 * nf,
            "mask_encode_fields": nf * row + sum(s.numel + s.nbytes for s in coded) + 16 * nf}


def _coded_plan() -> tuple[MC.MaskPlan, list[torch.Tensor]]:
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, 2, "flat")
    plan = MC.MaskPlan(part, lay, mask_counts(part, lay, 0.1), "auto", lay.total)
    assert {MC.BITMAP, MC.ELIAS_FANO, MC.ALL} <= set(plan.kinds())
    return plan, _owners_bits(lay, part, 0.1, 0)


def test_counted_encode_bytes_follow_the_plan():
    plan, own = _coded_plan()
    with DeviceOpCounter() as ops:
        for r in range(2):
            plan.encode(own[r], r, "triton")
    want: dict[str, int] = {}
    for codes in plan.segs:
        for name, nbytes in _encode_bytes(codes).items():
            want[name] = want.get(name, 0) + nbytes
    assert dict(ops.kernel_bytes) == {k: v for k, v in want.items() if v}


def test_counted_decode_bytes_follow_the_plan():
    plan, own = _coded_plan()
    gathered = torch.cat([plan.encode(own[r], r, "triton") for r in range(2)])
    row = 8 * len(TC._COLUMNS)
    flat = [s for codes in plan.segs for s in codes]
    scanned = [s for s in flat if s.kind in (MC.BITMAP, MC.ELIAS_FANO)]
    listed = [s for s in flat if s.kind in (MC.ALL, MC.INDICES)]
    ns = (_tasks([s.numel for s in flat if s.kind == MC.BITMAP], TC.BLOCK)
          + _tasks([8 * s.high_bytes for s in flat if s.kind == MC.ELIAS_FANO], TC.BLOCK))
    nd = _tasks([s.numel if s.kind == MC.ALL else s.k for s in listed], TC.BLOCK)
    plan.decode_parts(gathered, CPU, "triton")              # builds the plan's task tables
    with DeviceOpCounter() as ops:
        _, idx, bits = plan.decode_parts(gathered, CPU, "triton")
    # per one: its 8-byte index written, and its bit ORed into an int32 word (4 B)
    assert dict(ops.kernel_bytes) == {
        "mask_decode_count": ns * row + sum(s.high_bytes for s in scanned) + 8 * ns,
        "mask_decode_scan": ns * row + 16 * ns + sum(s.high_bytes + s.low_bytes + 12 * s.k
                                                     for s in scanned),
        "mask_decode_direct": nd * row + sum(s.low_bytes + 12 * (s.numel if s.kind == MC.ALL
                                                                 else s.k) for s in listed)}
    # dispatched ops: the block starts' scan, the index vector, the bits' zero fill (1/8 byte per
    # element, not the byte per element of a bool mask)
    assert ops.bytes_moved - sum(ops.kernel_bytes.values()) < plan.total // 2
    assert bits.numel() == traffic.bits_bytes(plan.total) and bits.numel() % 16 == 0
    assert ops.ops["triton::mask_decode_scan"] == 1


CUDA_GRID_MAX = (2 ** 31 - 1, 65535, 65535)


@pytest.mark.parametrize("rows, n", [(1, 300_000_000), (1, 2 ** 34), (64, 2 ** 28)])
def test_fp8_launch_grids_stay_within_cudas_limits(rows, n, monkeypatch):
    """A row above ~268M values (world size 1, a large k) took more than 65,535 programs in
    grid y; the grids, computed without launching (meta tensors), fit CUDA's limits and cover
    every block."""
    grids = []
    monkeypatch.setattr(TP, "launch", lambda kernel, grid, *a, **k: grids.append(grid))
    x = torch.empty(rows, n, device="meta")
    nb = -(-n // SCALE_BLOCK)
    TP.decode(TP.encode(x, "fp8_e4m3", n + nb), n, "fp8_e4m3")
    assert len(grids) == 2
    for grid in grids:
        assert all(g <= limit for g, limit in zip(grid, CUDA_GRID_MAX)), grid
        programs = 1
        for g in grid:
            programs *= g
        assert programs * TP.SCALE_GROUPS >= rows * nb > (programs - rows) * TP.SCALE_GROUPS


@pytest.mark.parametrize("name", LOWP)
def test_counted_payload_bytes(name):
    rows, n = 3, 1000
    x = _spread(rows * n, 1).view(rows, n)
    codec = PayloadCodec(name, "triton")
    with DeviceOpCounter() as ops:
        codec.decode(codec.encode(x), n)
    # bf16: 4 B read and 2 B written per value; fp8: 4 + 1, and one exponent byte per block
    per_call = 6 * rows * n if name == "bf16" else rows * (5 * n + codec.nblocks(n))
    assert dict(ops.kernel_bytes) == {f"payload_encode_{name}": per_call,
                                      f"payload_decode_{name}": per_call}
