"""CPU offload with double buffering: a flat tensor that lives in host memory (spec §4).

SCAPE keeps each rank's residual ``e^(r)`` (and optionally the fp32 master parameters) full size;
on GPU they can live in pinned host memory instead of device memory. :class:`HostBuffer` holds
such a tensor and walks it in chunks:

    buf = HostBuffer(numel, device="cuda", chunk_numel=1 << 22)
    def fn(start, end, chunk):          # chunk: the elements [start, end) on the device
        chunk.mul_(beta).add_(grad_flat[start:end])
    buf.for_each_chunk(fn)              # the host copy now holds the updated values

On CUDA, two device staging buffers alternate, and the copies run on a side stream: while chunk i
is processed on the current stream, chunk i+1 is copied host->device and chunk i-1 device->host.
Events order the streams (a chunk is processed only after it has arrived; a staging buffer is
refilled only after its previous chunk has been copied back). ``for_each_chunk`` returns once the
host tensor is up to date, so the CPU may read ``host`` right after it.

On CPU (``device="cpu"``) each chunk is a view of the host tensor itself: no copies.

Either way ``fn`` sees exactly the same values it would see on the whole tensor, chunk by chunk,
so the result is bit-identical to applying an elementwise ``fn`` to the whole tensor at once. ``fn``
must treat chunks independently (elementwise work indexed by ``start``/``end``); it must not keep
a reference to ``chunk`` after it returns (on CUDA the staging buffer is reused).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...host_to_device import pinned_zeros

ChunkFn = Callable[[int, int, torch.Tensor], Any]


class HostBuffer:
    """A flat ``numel``-element tensor in host memory, processed on ``device`` in chunks."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", chunk_numel: int = 1 << 22,
                 pin: bool = True) -> None:
        if numel < 0:
            raise ValueError(f"HostBuffer: numel must be >= 0, got {numel}")
        if chunk_numel <= 0:
            raise ValueError(f"HostBuffer: chunk_numel must be > 0, got {chunk_numel}")
        self.numel = int(numel)
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"HostBuffer: device must be cpu or cuda, got {self.device}")
        self.chunk_numel = int(chunk_numel)
        # Pinned (page-locked) memory is what makes non_blocking copies truly asynchronous.
        self.pinned = bool(pin) and self.device.type == "cuda"
        self.host = pinned_zeros(self.numel, dtype, pin=self.pinned)
        self._staging: list[torch.Tensor] | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied_back: torch.cuda.Event | None = None   # the last pass's last host write

    # ------------------------------------------------------------------------------------------

    def chunks(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges that :meth:`for_each_chunk` visits, in order."""
        return [(s, min(s + self.chunk_numel, self.numel))
                for s in range(0, self.numel, self.chunk_numel)]

    def for_each_chunk(self, fn: ChunkFn, writeback: bool = True) -> None:
        """Call ``fn(start, end, chunk)`` for every chunk; in-place changes reach ``host``.

        ``writeback=False`` skips the device->host copies (for a read-only pass). On CUDA it
        returns once the work is queued: the host tensor is up to date after :meth:`wait_host`.
        """
        if self.device.type == "cpu":
            for start, end in self.chunks():
                fn(start, end, self.host[start:end])
            return
        self._for_each_chunk_cuda(fn, writeback)

    def _for_each_chunk_cuda(self, fn: ChunkFn, writeback: bool) -> None:
        ranges = self.chunks()
        if not ranges:
            return
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
                width = min(self.chunk_numel, self.numel)
                self._staging = [torch.empty(width, dtype=self.dtype, device=self.device)
                                 for _ in range(2)]
            copy, staging = self._copy_stream, self._staging
            assert staging is not None
            # Earlier work on the current stream may still use the staging buffers or the inputs
            # fn reads; the side stream must not overtake it.
            copy.wait_stream(compute)
            arrived = [torch.cuda.Event() for _ in ranges]   # chunk i is on the device
            processed = [torch.cuda.Event() for _ in ranges]  # fn(chunk i) has finished

            def stage(i: int) -> torch.Tensor:
                start, end = ranges[i]
                return staging[i % 2][: end - start]

            def host_to_device(i: int) -> None:
                start, end = ranges[i]
                with torch.cuda.stream(copy):
                    stage(i).copy_(self.host[start:end], non_blocking=True)
                    arrived[i].record(copy)

            def device_to_host(i: int) -> None:
                start, end = ranges[i]
                with torch.cuda.stream(copy):
                    copy.wait_event(processed[i])
                    self.host[start:end].copy_(stage(i), non_blocking=True)

            host_to_device(0)
            for i, (start, end) in enumerate(ranges):
                # Queue on the side stream, in this order: chunk i-1 back to the host (it waits for
                # fn(i-1)), then chunk i+1 in -- into the buffer chunk i-1 just vacated, which
                # stream order makes safe. Both overlap fn(i) below.
                if i >= 1 and writeback:
                    device_to_host(i - 1)
                if i + 1 < len(ranges):
                    if not writeback and i >= 1:
                        copy.wait_event(processed[i - 1])  # buffer reuse still needs fn(i-1) done
                    host_to_device(i + 1)
                compute.wait_event(arrived[i])
                fn(start, end, stage(i))
                processed[i].record(compute)
            if writeback:
                device_to_host(len(ranges) - 1)
            else:
                copy.wait_event(processed[-1])
            # Later work on the current stream (which may reuse the staging buffers) follows the
            # last copy. The host waits for it only where it reads or writes ``host`` itself
            # (wait_host): waiting here would stall the host once per step, on every fold.
            done = torch.cuda.Event()
            done.record(copy)
            compute.wait_event(done)
            self._copied_back = done

    def wait_host(self) -> "HostBuffer":
        """Wait until the copies queued by the last pass have reached ``host`` (CUDA): before
        the host reads it (a checkpoint) or writes it (a load)."""
        if self._copied_back is not None:
            self._copied_back.synchronize()
            self._copied_back = None
        return self

    # ------------------------------------------------------------------------------------------

    def zero_(self) -> HostBuffer:
        self.wait_host().host.zero_()
        return self

    def state_dict(self) -> dict[str, Any]:
        """``{"host": tensor}``: plain tensors only, so ``torch.load(weights_only=True)`` works."""
        return {"host": self.wait_host().host}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a saved tensor into ``host`` (keeps this buffer's pinned memory and dtype)."""
        if "host" not in state or not isinstance(state["host"], torch.Tensor):
            raise KeyError("HostBuffer.load_state_dict: expected a dict with a 'host' tensor")
        src = state["host"]
        if src.numel() != self.numel:
            raise ValueError(f"HostBuffer.load_state_dict: saved buffer has {src.numel()} "
                             f"elements, this one {self.numel}")
        if src.dtype != self.dtype:
            raise TypeError(f"HostBuffer.load_state_dict: saved dtype {src.dtype}, this buffer "
                            f"{self.dtype}; build the buffer with the saved dtype")
        self.wait_host().host.copy_(src.reshape(-1))

    def __repr__(self) -> str:
        return (f"HostBuffer(numel={self.numel}, dtype={self.dtype}, device={self.device}, "
                f"chunk_numel={self.chunk_numel}, pinned={self.pinned})")
