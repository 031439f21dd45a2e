"""SCAPE's wire format in one process: mask codings (round trips at odd lengths and offsets, sizes,
the auto choice, no host sync) and the payload codec (round trips, exact error feedback, scales)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from scape_train.optim import build_optimizer
from scape_train.comm import Comm
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.density import segment_k
from scape_train.optim.scape import mask_coding as MC
from scape_train.optim.scape import mask_format as MF
from scape_train.optim.scape import torch_codecs as TC
from scape_train.optim.scape.kernels import pack_bits, unpack_bits
from scape_train.optim.scape.masks import Mask, MaskExchange, mask_counts, topk_own_mask
from scape_train.optim.scape.partition import ParamLayout, build_partition
from scape_train.optim.scape.payload import SCALE_BLOCK, PayloadCodec, all_reduce_mean
from scape_train.optim.scape.torch_passes import TorchPasses
from scape_train.profiling import DeviceOpCounter

from ._optim_common import flat_params, make, tiny_model, train_step

CODINGS = ["bitmap", "indices", "elias_fano", "auto"]
LOWP = ["bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]
TORCH = TorchPasses()


def _decoded(plan: MC.MaskPlan, gathered: torch.Tensor | None) -> torch.Tensor:
    """The bool mask the torch codecs decode from the owners' shards."""
    dense, idx, bits = plan.decode(gathered, torch.device("cpu"), TORCH)
    return Mask(plan.total, dense=dense, indices=idx, bits=bits).dense()


def odd_model() -> nn.Module:
    """Odd tensor sizes (1, 7, 37·53 ...), biases and a norm gain: segments at odd flat offsets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 53), nn.LayerNorm(53), nn.Linear(53, 7, bias=False),
                         nn.Linear(7, 1), nn.Linear(1, 3, bias=False))


def _owners_bits(lay, part, density, seed):
    stat = torch.randn(lay.total, generator=torch.Generator().manual_seed(seed))
    return [topk_own_mask(stat[lo:hi], part, r, lay, density)
            for r, (lo, hi) in enumerate(part.ranges)]


# -- mask codings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("world,partitioner", [(1, "flat"), (2, "tensor"), (3, "flat"),
                                               (5, "flat"), (7, "tensor")])
def test_mask_coding_round_trip(coding, world, partitioner):
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, world, partitioner)
    for seed, density in enumerate([0.001, 0.01, 0.07, 0.3, 0.61, 0.99, 1.0]):
        own = _owners_bits(lay, part, density, seed)
        plan = MC.MaskPlan(part, lay, mask_counts(part, lay, density), coding, lay.total)
        shards = [plan.encode(own[r], r, TORCH) for r in range(world)]
        assert all(s.numel() == plan.shard_bytes for s in shards)
        if not plan.legacy:   # the coded bytes end where the plan says (the rest is padding)
            for r, s in enumerate(shards):
                assert int(s[plan.rank_bytes[r]:].count_nonzero()) == 0
        gathered = torch.cat(shards) if plan.shard_bytes else None
        assert torch.equal(_decoded(plan, gathered), torch.cat(own)), (coding, world, density)


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 8, 9, 63, 64, 65, 1000, 4097])
def test_every_segment_coding_round_trips_every_k(numel):
    """One segment at an odd flat offset (after a 13-element excluded tensor), each coding, k from
    1 to numel - 1 (spot-checked for large numel), random and edge positions."""
    torch.manual_seed(numel)
    model = nn.Module()
    model.gain = nn.Parameter(torch.ones(13))              # 1-D: excluded, all ones
    model.weight = nn.Parameter(torch.randn(1, numel))
    lay = ParamLayout(model, weight_decay=0.0, exclude_norm_bias=True)
    part = build_partition(lay, 1, "flat")
    ks = sorted({1, 2, numel // 3, numel // 2, numel - 1} - {0}) if numel > 1 else [1]
    for kind, k in itertools.product([MF.BITMAP, MF.INDICES, MF.ELIAS_FANO], ks):
        for positions in ("random", "first", "last"):
            bits = torch.zeros(numel, dtype=torch.bool)
            if positions == "random":
                bits[torch.randperm(numel)[:k]] = True
            elif positions == "first":
                bits[:k] = True
            else:
                bits[numel - k:] = True
            full = torch.cat([torch.ones(13, dtype=torch.bool), bits])
            plan = MC.MaskPlan(part, lay, [[13, k]], "auto", lay.total)
            if k < numel:   # force the coding under test on the second segment
                plan.segs[0][1] = MF.seg_code(kind, 13, numel, k, 0)
                plan.rank_bytes = [plan.segs[0][1].nbytes]
                plan.shard_bytes = plan.rank_bytes[0]
                plan.cache = {}
                assert plan.shard_bytes == MF.coded_bytes(kind, numel, k)
            shard = plan.encode(full, 0, TORCH)
            got = _decoded(plan, shard if plan.shard_bytes else None)
            assert torch.equal(got, full), (kind, numel, k, positions)


def test_coding_sizes_and_the_auto_choice():
    n = 6_291_456                                        # a Llama-500M projection (1536 x 4096)
    for d, ef_bits in [(0.01, 8.6), (0.1, 5.3)]:
        k = segment_k(n, d)
        ef = MF.coded_bytes(MF.ELIAS_FANO, n, k)
        assert ef * 8 / k == pytest.approx(ef_bits, abs=0.05)
        assert ef < MF.coded_bytes(MF.BITMAP, n, k) and ef < MF.coded_bytes(MF.INDICES, n, k)
        assert MF.choose("auto", n, k, excluded=False) == MF.ELIAS_FANO
    assert MF.index_width(n) == 23
    # dense masks: the bitmap wins; a single one in a small segment: plain indices
    assert MF.choose("auto", 1000, 600, excluded=False) == MF.BITMAP
    assert MF.choose("auto", 1 << 20, 1, excluded=False) == MF.INDICES
    # all-ones segments are not sent
    assert MF.choose("auto", 100, 3, excluded=True) == MF.ALL
    assert MF.choose("indices", 100, 100, excluded=False) == MF.ALL
    # auto is the per-segment minimum, so never larger than any single coding
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    for world, d in itertools.product([2, 3, 4], [0.01, 0.2, 0.5]):
        part = build_partition(lay, world, "flat")
        counts = mask_counts(part, lay, d)
        sizes = {c: MC.MaskPlan(part, lay, counts, c, lay.total).rank_bytes for c in CODINGS}
        for c in ("indices", "elias_fano"):
            assert all(a <= b for a, b in zip(sizes["auto"], sizes[c]))
    # at density 1 nothing but bitmap sends anything
    part = build_partition(lay, 3, "flat")
    assert MC.MaskPlan(part, lay, mask_counts(part, lay, 1.0), "auto", lay.total).shard_bytes == 0


def test_field_reader_at_every_bit_offset():
    g = torch.Generator().manual_seed(0)
    for width in (1, 2, 5, 8, 13, 23, 33):
        vals = torch.randint(0, 1 << width, (41,), generator=g)
        for pad in range(8):    # fields starting at every bit offset inside a byte
            stream = TC._pack_fields(vals, width)
            bits = torch.cat([torch.zeros(pad, dtype=torch.bool),
                              unpack_bits(stream, vals.numel() * width)])
            buf = torch.cat([pack_bits(bits), torch.zeros(8, dtype=torch.uint8)])
            starts = pad + torch.arange(vals.numel()) * width
            got = TC._read_fields(buf, starts >> 3, starts & 7,
                                  TC._ones_below(torch.full_like(starts, width)))
            assert torch.equal(got, vals), (width, pad)


def test_exchange_decodes_without_host_sync():
    lay = ParamLayout(odd_model(), weight_decay=0.1, exclude_norm_bias=True)
    part = build_partition(lay, 1, "flat")
    ex = MaskExchange(part, Comm(), lay.total, TORCH, layout=lay, coding="auto")
    bits = _owners_bits(lay, part, 0.05, 3)[0]
    ex.start(bits, 0.05).wait()                    # builds the plan's device tables
    with DeviceOpCounter() as ops:
        got = ex.start(bits, 0.05).wait()
    assert dict(ops.sync_sites) == {}
    assert torch.equal(got, bits)


@pytest.mark.parametrize("sharded", [False, True])
def test_codings_give_bit_identical_training_one_worker(sharded):
    runs = {}
    for coding in CODINGS:
        cfg = OptimizerConfig(name="scape", lr=1e-2, density=0.05, density_warmup_steps=3,
                              mask_coding=coding, sharded=sharded)
        s, w, _ = make(cfg)
        for t in range(1, 5):
            train_step(s, w, t, 0)
        runs[coding] = (flat_params(w), s.mask_cur.clone())
    for coding in CODINGS[1:]:
        assert torch.equal(runs[coding][0], runs["bitmap"][0]), coding
        assert torch.equal(runs[coding][1], runs["bitmap"][1]), coding


def test_triton_path_equals_torch_path_with_coded_masks_and_fp8():
    """use_triton=on (interpreted on CPU here) gives bit-identical results with the new format."""
    for sharded in (False, True):
        kw = dict(name="scape", lr=1e-2, density=0.2, density_schedule="constant",
                  mask_coding="auto", payload_dtype="fp8_e4m3", sharded=sharded)
        a, wa, _ = make(OptimizerConfig(**kw, use_triton="off"))
        b, wb, _ = make(OptimizerConfig(**kw, use_triton="on"))
        for t in range(1, 4):
            train_step(a, wa, t, 0)
            train_step(b, wb, t, 0)
        assert torch.equal(flat_params(wa), flat_params(wb))
        assert torch.equal(a.mask_cur, b.mask_cur)
        assert torch.equal(a.reference.state.residual.full(), b.reference.state.residual.full())


# -- payload codec --------------------------------------------------------------------------------

def _spread(n: int, seed: int) -> torch.Tensor:
    """Values over ~60 binades, both signs, with exact zeros and a few tiny/huge ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    x[::17] = 0.0
    if n > 5:
        x[3], x[5] = 1e-38, -3e37
    return x


@pytest.mark.parametrize("name", ["fp32"] + LOWP)
@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 255, 1000, 3 * SCALE_BLOCK + 5])
def test_payload_round_trip_and_exact_error(name, n):
    codec = PayloadCodec(name)
    for rows in (1, 3):
        x = torch.stack([_spread(n, seed) for seed in range(rows)])
        wire, d = codec.round_trip(x)
        assert wire.dtype == torch.uint8 and wire.shape == (rows, codec.nbytes(n))
        assert torch.equal(codec.decode(wire, n), d)                 # deterministic decoding
        err = x - d
        assert torch.equal(d + err, x)                               # error feedback loses nothing
        if name == "fp32":
            assert torch.equal(d, x)
            continue
        nz = d != 0
        assert torch.all((d[nz] >= x[nz] / 2) & (d[nz] <= 2 * x[nz]) | (x[nz] < 0)
                         & (d[nz] <= x[nz] / 2) & (d[nz] >= 2 * x[nz]))   # Sterbenz holds
        assert torch.all(torch.sign(d[nz]) == torch.sign(x[nz]))
        if name == "bf16":
            torch.testing.assert_close(d, x, rtol=2 ** -8, atol=0)
        else:   # relative to the block maximum: the element's rounding step
            # mantissa bits, and how far below the block maximum the type's normals reach
            mant, reach = {"fp8_e4m3": (3, -14), "fp8_e5m2": (2, -28), "fp4_e2m1": (1, -2)}[name]
            pad = -(-n // SCALE_BLOCK) * SCALE_BLOCK
            amax = torch.nn.functional.pad(x.abs(), (0, pad - n)).view(rows, -1, SCALE_BLOCK) \
                .amax(2).repeat_interleave(SCALE_BLOCK, 1)[:, :n]
            normal = x.abs() >= amax * 2.0 ** reach
            assert torch.all((err.abs() <= x.abs() * 2.0 ** -mant)[normal])


def _special(n: int) -> torch.Tensor:
    """Zeros of both signs, subnormals, large and tiny normals, values that cross a block's scale.
    (Values within a rounding step of fp32's largest, e.g. 3.4e38, decode to inf.)"""
    vals = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1.17e-38, 3.0e38, -3.0e38, 1.0, -1.0,
                         2.0 ** -126, 448.0, 57344.0, 2.0 ** 100, 2.0 ** -100])
    return vals.repeat(-(-n // vals.numel()))[:n]


@pytest.mark.parametrize("name", LOWP)
@pytest.mark.parametrize("n", [0, 1, 5, 127, 128, 129, 1000, 3 * SCALE_BLOCK + 5])
def test_payload_special_values_and_strided_rows(name, n):
    """Special values, an all-zero block, a subnormal block; rows of a larger buffer decode as
    the same bytes do contiguously; ``n = 0`` gives empty rows."""
    codec = PayloadCodec(name)
    for rows in (1, 3):
        x = torch.stack([_spread(n, s) for s in range(rows - 1)] + [_special(n)])
        if n > 2 * SCALE_BLOCK:
            x[:, SCALE_BLOCK:2 * SCALE_BLOCK] = 0.0                    # an all-zero block
            x[:, 2 * SCALE_BLOCK:] *= 2.0 ** -140                      # a subnormal block
        wire, d = codec.round_trip(x)
        assert wire.shape == (rows, codec.nbytes(n)) and d.shape == (rows, n)
        if n == 0:
            continue
        assert torch.isfinite(d).all()
        assert torch.equal(d + (x - d), x)                             # exact error feedback
        zero = x == 0
        assert not d[zero].any() and torch.equal(d[zero].signbit(), x[zero].signbit())
        strided = torch.cat([wire, wire], dim=1)[:, :wire.shape[1]]   # rows of a larger buffer
        assert torch.equal(codec.decode(strided, n).view(torch.int32), d.view(torch.int32))


def test_fp8_scales_are_powers_of_two_and_never_overflow():
    for name, top in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        codec = PayloadCodec(name)
        x = torch.tensor([[1.0, -1.0 + 2 ** -20, 255.9, 0.0] + [3.0] * 124 + [2 ** 100] * 2])
        wire, d = codec.round_trip(x)
        e = wire[0, x.shape[1]:].view(torch.int8).tolist()
        assert len(e) == 2
        q = wire[0, :x.shape[1]].view(codec_dtype(name)).float()
        assert q.abs().max() < top and torch.isfinite(d).all()
        assert torch.equal(d[0, 128:], torch.tensor([2.0 ** 100] * 2))


def test_fp4_packs_two_e2m1_codes_a_byte_rounding_to_the_nearest():
    """fp4_e2m1: ceil(n/2) bytes and one scale; with a block maximum of 3.5 the scale is 2^0, so
    the decoded values are the E2M1 grid's nearest (a tie to the smaller), signs and -0 kept."""
    codec = PayloadCodec("fp4_e2m1")
    x = torch.tensor([[3.5, -0.3, 0.25, 0.75, 1.3, -2.6, -0.0, 0.1, 1.75]])
    wire, d = codec.round_trip(x)
    assert wire.shape == (1, 5 + 1) and wire[0, 5].view(torch.int8) == 0
    assert d.tolist() == [[3.0, -0.5, 0.0, 0.5, 1.5, -3.0, -0.0, 0.0, 1.5]]
    assert d[0, 6].signbit() and not d[0, 7].signbit()
    assert wire[0, 0] == (5 | (8 | 1) << 4)              # 3.0 is code 5, -0.5 is 8 | 1


def codec_dtype(name):
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]


@pytest.mark.parametrize("name", LOWP)
def test_one_process_all_reduce_conserves(name):
    codec = PayloadCodec(name)
    x = _spread(1001, 7)
    out, err = all_reduce_mean(x, Comm(), codec, kind="payload")
    assert torch.equal(out + err, x)      # n = 1: what is applied plus the residual is exact


@pytest.mark.parametrize("field,value", [("mask_coding", "rle"), ("payload_dtype", "fp16")])
def test_bad_wire_config_is_a_clear_error(field, value):
    cfg = OptimizerConfig(name="scape")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=field):
        build_optimizer(cfg, tiny_model())
    with pytest.raises(ValueError, match="payload_dtype"):
        build_optimizer(OptimizerConfig(name="adams", payload_dtype="bf16"), tiny_model())


def test_defaults_in_yaml_match_the_dataclass():
    import yaml
    from pathlib import Path
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "optimizer"
                          / "scape.yaml").read_text())
    assert raw["mask_coding"] == OptimizerConfig.mask_coding == "auto"
    assert raw["payload_dtype"] == OptimizerConfig.payload_dtype == "fp32"
