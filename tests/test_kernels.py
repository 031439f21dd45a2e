"""SCAPE's 1-bit masks: the torch ops' semantics, and the Triton passes' packing (interpreted on
CPU) == the torch passes'.

conftest.py sets TRITON_INTERPRET=1 before triton is imported, so ``use_triton=on`` runs the real
kernels on CPU tensors here; on a GPU machine the CUDA test at the end runs them compiled.
"""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.scape import kernels as K
from scape_train.optim.scape.strategy import select_passes
from scape_train.optim.scape.torch_passes import TorchPasses

needs_triton = pytest.mark.skipif(not K.triton_available(), reason="needs triton (Linux)")
LIBS = ["off", pytest.param("on", marks=needs_triton)]
TINY = list(range(1, 18))
SIZES = TINY + [0, 64, 1000, 4095, 4096, 4097, 12_345]
CPU = torch.device("cpu")


def _mask(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) < density


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


# ---------------------------------------------------------------------------- bit layout


def test_bit_order_is_little_endian_hand_computed() -> None:
    # elements 0, 2, 3 set in byte 0 -> 0b00001101 = 13; element 8 set alone -> byte 1 = 1;
    # element 15 -> bit 7 of byte 1 -> 1 + 128 = 129
    mask = torch.zeros(17, dtype=torch.bool)
    mask[[0, 2, 3, 8, 15]] = True
    packed = K.pack_bits(mask)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [13, 129, 0]


@pytest.mark.parametrize("use_triton", LIBS)
def test_hand_computed_bytes_both_passes(use_triton: str) -> None:
    lib = select_passes(use_triton, CPU)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert lib.pack_bits(mask).tolist() == [13, 1]
    assert lib.unpack_bits(torch.tensor([13, 1], dtype=torch.uint8), 9).tolist() == mask.tolist()


@pytest.mark.parametrize("use_triton", LIBS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_round_trip(use_triton: str, n: int) -> None:
    lib = select_passes(use_triton, CPU)
    mask = _mask(n, 0.4, seed=n)
    packed = lib.pack_bits(mask)
    assert packed.shape == (K.packed_numel(n),)
    assert torch.equal(lib.unpack_bits(packed, n), mask)
    if n % 8:  # padding bits are zero
        assert int(packed[-1]) >> (n % 8) == 0


@needs_triton
@pytest.mark.parametrize("n", SIZES)
def test_triton_pack_unpack_equals_torch(n: int) -> None:
    lib = select_passes("on", CPU)
    for density in (0.0, 0.3, 1.0):
        mask = _mask(n, density, seed=n + 1)
        assert torch.equal(lib.pack_bits(mask), K.pack_bits(mask))
        # random bytes, padding bits included, must unpack the same way
        noise = torch.randint(0, 256, (K.packed_numel(n),), dtype=torch.uint8)
        assert torch.equal(lib.unpack_bits(noise, n), K.unpack_bits(noise, n))


@needs_triton
@pytest.mark.parametrize("start,stop", [(3, 1000), (1, 9), (5, 5 + 8192 + 13), (7, 8)])
def test_triton_pack_on_slices_at_odd_offsets(start: int, stop: int) -> None:
    mask = _mask(stop + 11, 0.3, seed=stop)[start:stop]
    assert mask.storage_offset() == start
    assert torch.equal(select_passes("on", CPU).pack_bits(mask), K.pack_bits(mask))
    two_d = _mask(40 * 30, 0.2, seed=4).view(30, 40).t()            # non-contiguous
    assert torch.equal(select_passes("on", CPU).pack_bits(two_d), K.pack_bits(two_d))


# ---------------------------------------------------------------------------- gather / scatter


def test_gather_scatter_semantics() -> None:
    values = torch.arange(10.0)
    mask = torch.tensor([0, 1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    payload = K.gather_masked(values, mask)
    assert payload.tolist() == [1.0, 4.0, 5.0, 9.0]  # increasing index order
    out = torch.full((10,), -1.0)
    assert K.scatter_masked(payload * 10, mask, out) is out
    assert out.tolist() == [-1, 10, -1, -1, 40, 50, -1, -1, -1, 90]


def _check_gather_scatter(values: torch.Tensor, mask: torch.Tensor) -> None:
    """With the popcount given (no host read: nonzero_static and an index op), the same as
    boolean indexing; scatter writes only the mask's positions."""
    count = int(mask.sum())
    ref = K.gather_masked(values, mask)
    got = K.gather_masked(values, mask, count=count)
    assert got.dtype == values.dtype and torch.equal(got, ref)
    payload = -ref - 3  # distinct from whatever `out` holds
    base = _values(values.numel(), values.dtype, seed=99).view(values.shape)
    expect = base.clone()
    expect[mask] = payload
    out = base.clone()
    assert K.scatter_masked(payload, mask, out, count=count) is out
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 4097])
def test_gather_scatter_with_the_count_given(n: int, dtype: torch.dtype) -> None:
    for density in (0.0, 0.05, 0.5, 1.0):  # empty, sparse, half, all-ones
        _check_gather_scatter(_values(n, dtype, seed=n), _mask(n, density, seed=7 * n + 1))
    # views at an odd storage offset; scatter into one writes through, inside the slice only
    parent, mask = _values(1011, dtype, seed=2), _mask(1011, 0.3, seed=3)
    _check_gather_scatter(parent[3:1000], mask[3:1000])
    out, expect = parent.clone(), parent.clone()
    K.scatter_masked(torch.zeros(int(mask[3:1000].sum()), dtype=dtype), mask[3:1000],
                     out[3:1000], count=int(mask[3:1000].sum()))
    expect[3:1000][mask[3:1000]] = 0
    assert torch.equal(out, expect)
    values = _values(40 * 30, torch.float32, seed=3).view(40, 30).t()  # non-contiguous
    _check_gather_scatter(values, _mask(40 * 30, 0.2, seed=4).view(30, 40))


def test_topk_segments_tie_rule_hand_computed() -> None:
    """The torch select's order: |c| descending, then index ascending (-0 = +0, NaN above
    inf, whatever their signs), with no host read."""
    from scape_train.profiling import DeviceOpCounter
    nan, inf = float("nan"), float("inf")
    stat = torch.tensor([1.0, -2.0, 2.0, 0.0, -0.0, 1.0, 0.0,      # k 3: a tie at 1
                         -inf, nan, inf, -nan, 3.0,                  # k 3: a tie at inf
                         0.0, -0.0, 0.0, -0.0])                      # k 2: all tied
    with DeviceOpCounter() as ops:
        bits = K.topk_segments(stat, ((0, 7, 3), (7, 5, 3), (12, 4, 2)))
    assert ops.host_syncs == 0, ops.sync_sites
    assert bits.tolist() == [True, True, True, False, False, False, False,
                             True, True, False, True, False,
                             True, True, False, False]


def test_bits_are_copied_exactly() -> None:
    # NaN payloads and -0.0 survive: gather and scatter move values, they never compute on them
    bits = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 3.0]).view(torch.int32).clone()
    bits[0] = 0x7FC01234  # a NaN with a payload
    values = bits.view(torch.float32)
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    got = K.gather_masked(values, mask, count=4)
    assert got.view(torch.int32).tolist() == bits[mask].tolist()


# --------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("use_triton", LIBS)
def test_validation_errors(use_triton: str) -> None:
    lib = select_passes(use_triton, CPU)
    mask = torch.tensor([1, 0, 1], dtype=torch.bool)
    with pytest.raises(TypeError, match="bool"):
        lib.pack_bits(torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="ceil"):
        lib.unpack_bits(torch.zeros(2, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        lib.unpack_bits(torch.zeros(1, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="same shape"):
        K.gather_masked(torch.zeros(4), mask)
    with pytest.raises(ValueError, match="popcount"):
        K.scatter_masked(torch.zeros(3), mask, torch.zeros(3))
    with pytest.raises(ValueError, match="popcount"):
        K.scatter_masked(torch.zeros(3), mask, torch.zeros(3), count=2)
    with pytest.raises(TypeError, match="dtype"):
        K.scatter_masked(torch.zeros(2, dtype=torch.float64), mask, torch.zeros(3))


def test_the_passes_are_chosen_by_the_config_value() -> None:
    assert isinstance(select_passes("auto", CPU), TorchPasses)  # the CPU never takes Triton
    assert isinstance(select_passes("off", CPU), TorchPasses)
    with pytest.raises(ValueError, match="auto, on or off"):
        select_passes("triton", CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_triton
def test_cuda_triton_equals_torch() -> None:
    # On a GPU machine this runs the compiled kernels (TRITON_INTERPRET must be unset there:
    # `TRITON_INTERPRET=0 pytest tests/test_kernels.py -k cuda`).
    lib = select_passes("auto", torch.device("cuda"))
    assert not isinstance(lib, TorchPasses)
    for n in (1, 17, 4097, 1_000_003):
        for density in (0.0, 0.01, 1.0):
            mask = _mask(n, density, seed=n).cuda()
            assert torch.equal(lib.pack_bits(mask), K.pack_bits(mask))
            packed = K.pack_bits(mask)
            assert torch.equal(lib.unpack_bits(packed, n), mask)
            _check_gather_scatter(_values(n, torch.float32, seed=n).cuda(), mask)
