"""Time SCAPE's mask kernels: pack and unpack in the torch and Triton passes, gather and scatter.

    python scripts/bench_kernels.py                      # CUDA if present, else CPU (torch only)
    python scripts/bench_kernels.py --numel 50000000 --density 0.01 --offload-chunk 4194304

Prints one line per kernel and passes: median milliseconds over --iters runs and the effective
bandwidth (bytes read + written / time). On CPU only the torch passes are timed (the Triton
interpreter is a correctness tool, not a fast path). Gather and scatter are torch ops on every
device (the popcount given: no host read). With --offload-chunk it also times one
HostBuffer.for_each_chunk pass (H2D + in-place update + D2H) against the same update in place.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch

from scape_train.optim.scape import kernels as K
from scape_train.optim.scape.offload import HostBuffer
from scape_train.optim.scape.strategy import select_passes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    fn()  # warm-up (Triton compiles here)
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=None, help="elements (default 64M GPU, 4M CPU)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of mask bits set")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--offload-chunk", type=int, default=0, help="also time HostBuffer (elements)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numel = args.numel or ((64 << 20) if device.type == "cuda" else (4 << 20))
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"device={device} ({name}) torch={torch.__version__} numel={numel} "
          f"density={args.density} dtype={args.dtype} iters={args.iters}")

    torch.manual_seed(0)
    values = torch.randn(numel, device=device).to(dtype)
    mask = torch.rand(numel, device=device) < args.density
    packed = K.pack_bits(mask)
    payload = K.gather_masked(values, mask)
    out = torch.zeros_like(values)
    esize, k = values.element_size(), payload.numel()

    libs = {"torch": select_passes("off", device)}
    if device.type == "cuda" and K.triton_available():
        libs["triton"] = select_passes("on", device)
    cases: list[tuple[str, int, Callable[[object], object]]] = [
        ("pack_bits", numel + numel // 8, lambda lib: lib.pack_bits(mask)),
        ("unpack_bits", numel // 8 + numel, lambda lib: lib.unpack_bits(packed, numel)),
    ]
    for label, nbytes, fn in cases:
        for b, lib in libs.items():
            ms = _time_ms(lambda: fn(lib), device, args.iters)
            print(f"{label:22s} {b:6s} {ms:9.3f} ms  {nbytes / ms / 1e6:8.1f} GB/s")
    for label, fn in (("gather_masked", lambda: K.gather_masked(values, mask, count=k)),
                      ("scatter_masked", lambda: K.scatter_masked(payload, mask, out, count=k))):
        ms = _time_ms(fn, device, args.iters)
        print(f"{label:22s} {'torch':6s} {ms:9.3f} ms  {(numel + 2 * k * esize) / ms / 1e6:8.1f} GB/s")

    if args.offload_chunk:
        buf = HostBuffer(numel, device=device, chunk_numel=args.offload_chunk)
        resident = torch.zeros(numel, device=device)

        def update(start: int, end: int, chunk: torch.Tensor) -> None:
            chunk.mul_(0.9).add_(1.0)

        ms_off = _time_ms(lambda: buf.for_each_chunk(update), device, args.iters)
        ms_res = _time_ms(lambda: update(0, numel, resident), device, args.iters)
        # on CPU the chunks are views (no copies), so only CUDA moves bytes across the bus
        moved = (f" ({2 * 4 * numel / ms_off / 1e6:.1f} GB/s host<->device)"
                 if device.type == "cuda" else " (CPU: chunks are views, no copies)")
        print(f"HostBuffer chunk={args.offload_chunk}: offloaded {ms_off:.3f} ms{moved}, "
              f"resident {ms_res:.3f} ms")


if __name__ == "__main__":
    main()
