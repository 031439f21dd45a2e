"""SCAPE mask kernels: torch path semantics, and Triton (interpreted on CPU) == torch path.

conftest.py sets TRITON_INTERPRET=1 before triton is imported, so backend="triton" runs the real
kernels on CPU tensors here; on a GPU machine the CUDA test at the end runs them compiled.
"""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.scape import kernels as K

needs_triton = pytest.mark.skipif(not K.triton_available(), reason="needs triton (Linux)")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
TINY = list(range(1, 18))
SIZES = TINY + [0, 64, 1000, 4095, 4096, 4097, 12_345]


def _mask(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) < density


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


# ---------------------------------------------------------------------------- bit layout (torch)


def test_bit_order_is_little_endian_hand_computed() -> None:
    # elements 0, 2, 3 set in byte 0 -> 0b00001101 = 13; element 8 set alone -> byte 1 = 1;
    # element 15 -> bit 7 of byte 1 -> 1 + 128 = 129
    mask = torch.zeros(17, dtype=torch.bool)
    mask[[0, 2, 3, 8, 15]] = True
    packed = K.pack_bits(mask, backend="torch")
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [13, 129, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_bytes_all_backends(backend: str) -> None:
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert K.pack_bits(mask, backend=backend).tolist() == [13, 1]
    assert K.unpack_bits(torch.tensor([13, 1], dtype=torch.uint8), 9,
                         backend=backend).tolist() == mask.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_round_trip(backend: str, n: int) -> None:
    mask = _mask(n, 0.4, seed=n)
    packed = K.pack_bits(mask, backend=backend)
    assert packed.shape == (K.packed_numel(n),)
    assert torch.equal(K.unpack_bits(packed, n, backend=backend), mask)
    if n % 8:  # padding bits are zero
        assert int(packed[-1]) >> (n % 8) == 0


def test_gather_scatter_semantics_torch() -> None:
    values = torch.arange(10.0)
    mask = torch.tensor([0, 1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    payload = K.gather_masked(values, mask, backend="torch")
    assert payload.tolist() == [1.0, 4.0, 5.0, 9.0]  # increasing index order
    out = torch.full((10,), -1.0)
    assert K.scatter_masked(payload * 10, mask, out, backend="torch") is out
    assert out.tolist() == [-1, 10, -1, -1, 40, 50, -1, -1, -1, 90]


# ------------------------------------------------------------------- triton == torch (interpreted)


@needs_triton
@pytest.mark.parametrize("n", SIZES)
def test_triton_pack_unpack_equals_torch(n: int) -> None:
    for density in (0.0, 0.3, 1.0):
        mask = _mask(n, density, seed=n + 1)
        p_torch = K.pack_bits(mask, backend="torch")
        p_triton = K.pack_bits(mask, backend="triton")
        assert torch.equal(p_triton, p_torch)
        # random bytes, padding bits included, must unpack the same way
        noise = torch.randint(0, 256, (K.packed_numel(n),), dtype=torch.uint8)
        assert torch.equal(K.unpack_bits(noise, n, backend="triton"),
                           K.unpack_bits(noise, n, backend="torch"))


def _check_gather_scatter(values: torch.Tensor, mask: torch.Tensor) -> None:
    ref = K.gather_masked(values, mask, backend="torch")
    got = K.gather_masked(values, mask, backend="triton")
    assert got.dtype == values.dtype and torch.equal(got, ref)

    payload = -ref - 3  # distinct from whatever `out` holds
    base = _values(values.numel(), values.dtype, seed=99).view(values.shape)
    expect = K.scatter_masked(payload, mask, base.clone(), backend="torch")
    out = base.clone()
    assert K.scatter_masked(payload, mask, out, backend="triton") is out
    assert torch.equal(out, expect)
    assert torch.equal(expect[~mask], base[~mask])  # off-mask entries untouched


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_triton_gather_scatter_equals_torch(n: int, dtype: torch.dtype) -> None:
    for density in (0.0, 0.05, 0.5, 1.0):  # empty, sparse, half, all-ones
        _check_gather_scatter(_values(n, dtype, seed=n), _mask(n, density, seed=7 * n + 1))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,stop", [(3, 1000), (1, 9), (5, 5 + 4096 + 13), (7, 8)])
def test_triton_on_slices_at_odd_offsets(dtype: torch.dtype, start: int, stop: int) -> None:
    full_values = _values(stop + 11, dtype, seed=start)
    full_mask = _mask(stop + 11, 0.3, seed=stop)
    values, mask = full_values[start:stop], full_mask[start:stop]
    assert values.storage_offset() == start
    _check_gather_scatter(values, mask)
    assert torch.equal(K.pack_bits(mask, backend="triton"), K.pack_bits(mask, backend="torch"))

    # scatter into a slice view writes through to the parent, and only inside the slice
    parent = full_values.clone()
    payload = K.gather_masked(values, mask, backend="torch") * 2
    K.scatter_masked(payload, mask, parent[start:stop], backend="triton")
    expect = full_values.clone()
    expect[start:stop][mask] = payload
    assert torch.equal(parent, expect)


@needs_triton
def test_triton_non_contiguous_and_2d() -> None:
    values = _values(40 * 30, torch.float32, seed=3).view(40, 30).t()  # non-contiguous
    mask = _mask(40 * 30, 0.2, seed=4).view(30, 40)
    _check_gather_scatter(values, mask)


@needs_triton
def test_triton_large_multi_block() -> None:
    n = 300_007  # many blocks, non-multiple of the block size and of 8
    _check_gather_scatter(_values(n, torch.float32, seed=5), _mask(n, 0.01, seed=6))


@needs_triton
def test_bits_are_copied_exactly() -> None:
    # NaN payloads and -0.0 must survive: the kernels move bits, they never compute on values
    values = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 3.0])
    bits = values.view(torch.int32).clone()
    bits[0] = 0x7FC01234  # a NaN with a payload
    values = bits.view(torch.float32)
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    got = K.gather_masked(values, mask, backend="triton")
    assert got.view(torch.int32).tolist() == bits[mask].tolist()


# --------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors(backend: str) -> None:
    mask = torch.tensor([1, 0, 1], dtype=torch.bool)
    with pytest.raises(TypeError, match="bool"):
        K.pack_bits(torch.tensor([1, 0, 1]), backend=backend)
    with pytest.raises(ValueError, match="ceil"):
        K.unpack_bits(torch.zeros(2, dtype=torch.uint8), 3, backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        K.unpack_bits(torch.zeros(1, dtype=torch.int32), 3, backend=backend)
    with pytest.raises(ValueError, match="same shape"):
        K.gather_masked(torch.zeros(4), mask, backend=backend)
    with pytest.raises(ValueError, match="popcount"):
        K.scatter_masked(torch.zeros(3), mask, torch.zeros(3), backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        K.scatter_masked(torch.zeros(2, dtype=torch.float64), mask, torch.zeros(3),
                         backend=backend)
    with pytest.raises(ValueError, match="backend"):
        K.pack_bits(mask, backend="cuda")


def test_auto_backend_is_torch_on_the_cpu() -> None:
    cpu = torch.zeros(3, dtype=torch.bool)
    assert K.resolve_backend("auto", cpu) == "torch"  # CPU tensors never go to triton by default
    assert K.resolve_backend("torch", cpu) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_triton
def test_cuda_triton_equals_torch() -> None:
    # On a GPU machine this runs the compiled kernels (TRITON_INTERPRET must be unset there:
    # `TRITON_INTERPRET=0 pytest tests/test_kernels.py -k cuda`).
    for n in (1, 17, 4097, 1_000_003):
        for density in (0.0, 0.01, 1.0):
            mask = _mask(n, density, seed=n).cuda()
            for dtype in (torch.float32, torch.bfloat16):
                values = _values(n, dtype, seed=n).cuda()
                _check_gather_scatter(values, mask)
            assert K.resolve_backend("auto", mask) == "triton"
            assert torch.equal(K.pack_bits(mask), K.pack_bits(mask, backend="torch"))
