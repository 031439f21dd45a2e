"""HostBuffer: chunked processing equals whole-tensor processing; state round trip; CUDA overlap."""

from __future__ import annotations

import io

import pytest
import torch

from scape_train.optim.scape.offload import HostBuffer


def _step_fn(grad: torch.Tensor, beta: float):
    """An error-feedback-like elementwise update that depends on the absolute position."""

    def fn(start: int, end: int, chunk: torch.Tensor) -> None:
        g = grad[start:end].to(chunk.device)
        chunk.mul_(beta).add_(g).addcmul_(g, g, value=-0.5)

    return fn


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("chunk_numel", [1, 7, 64, 1000, 1 << 22])
def test_for_each_chunk_equals_whole_tensor(device: str, chunk_numel: int) -> None:
    numel = 1003  # not a multiple of any chunk size used
    g = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) for _ in range(3)]

    whole = init.clone().to(device)  # same device as the chunks: same kernels, same rounding
    buf = HostBuffer(numel, device=device, chunk_numel=chunk_numel)
    buf.host.copy_(init)
    for grad in grads:
        _step_fn(grad, 0.9)(0, numel, whole)
        buf.for_each_chunk(_step_fn(grad, 0.9))
    assert torch.equal(buf.wait_host().host, whole.cpu())  # bit-identical, not merely close


def test_cpu_chunks_are_views_and_cover_everything() -> None:
    buf = HostBuffer(10, chunk_numel=4)
    assert buf.chunks() == [(0, 4), (4, 8), (8, 10)]
    seen: list[tuple[int, int]] = []

    def fn(start: int, end: int, chunk: torch.Tensor) -> None:
        seen.append((start, end))
        assert chunk.data_ptr() == buf.host[start:end].data_ptr()  # no copy on CPU
        chunk.fill_(start)

    buf.for_each_chunk(fn)
    assert seen == buf.chunks()
    assert buf.host.tolist() == [0] * 4 + [4] * 4 + [8] * 2
    assert not buf.pinned  # pinning only applies to CUDA staging
    HostBuffer(0).for_each_chunk(fn)  # empty buffer: fn never called
    assert seen == buf.chunks()


def test_state_dict_round_trip_weights_only() -> None:
    buf = HostBuffer(37, dtype=torch.float32, chunk_numel=8)
    buf.host.copy_(torch.linspace(-1, 1, 37))
    blob = io.BytesIO()
    torch.save(buf.state_dict(), blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=True)

    other = HostBuffer(37, chunk_numel=5)
    host_ptr = other.host.data_ptr()
    other.load_state_dict(state)
    assert torch.equal(other.host, buf.host)
    assert other.host.data_ptr() == host_ptr  # loaded into the existing (possibly pinned) memory

    assert other.zero_() is other and not other.host.any()
    with pytest.raises(ValueError, match="elements"):
        HostBuffer(36).load_state_dict(state)
    with pytest.raises(TypeError, match="dtype"):
        HostBuffer(37, dtype=torch.bfloat16).load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_numel"):
        HostBuffer(10, chunk_numel=0)
    with pytest.raises(ValueError, match="numel"):
        HostBuffer(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_overlap_and_read_only_pass() -> None:
    numel, chunk = 10_000_019, 1 << 20
    buf = HostBuffer(numel, device="cuda", chunk_numel=chunk)
    assert buf.pinned and buf.host.is_pinned() and buf.host.device.type == "cpu"
    buf.host.copy_(torch.arange(numel, dtype=torch.float32))
    # heavy work per chunk so that copies have something to overlap with
    buf.for_each_chunk(lambda s, e, c: c.mul_(2).sin_().asin_().mul_(0.5))
    expect = torch.arange(numel, dtype=torch.float32, device="cuda")
    expect.mul_(2).sin_().asin_().mul_(0.5)
    assert torch.equal(buf.wait_host().host, expect.cpu())

    before = buf.host.clone()
    sums: list[torch.Tensor] = []
    buf.for_each_chunk(lambda s, e, c: sums.append(c.double().sum()), writeback=False)
    assert torch.equal(buf.wait_host().host, before)
    assert torch.allclose(torch.stack(sums).sum().cpu(), before.double().sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_host_memory_is_exactly_its_size() -> None:
    """The caching host allocator behind ``pin_memory=True`` would round 600 MB up to 1 GiB."""
    stats = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    buf = HostBuffer(150_000_001, device="cuda")
    assert buf.host.is_pinned() and buf.host.untyped_storage().nbytes() == 600_000_004
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == stats
