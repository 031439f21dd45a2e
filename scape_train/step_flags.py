"""A step's agreed flags (loss, non-finite, stop), read on the host one step late.

Reading a device value blocks the host until the device has run everything queued before it. At
the end of a step that is the whole forward and backward: the GPU then idles while the host
issues the optimizer step and the next forward. So the trainer posts the step's flags (already
all-reduced, a float64 device tensor) with an asynchronous copy into pinned host memory and an
event, and takes them at the next step, when the device is long past them: the event has fired,
and the read is of host memory. Where the host must know now (a log, evaluation or checkpoint
step, the end), it takes them at once.
"""

from __future__ import annotations

import torch

from scape_train.profiling import host_tables


class StepFlags:
    """One step's flags in flight: :meth:`post` after the all-reduce, :meth:`take` later."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._host = torch.empty(3, dtype=torch.float64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._step: int | None = None

    @property
    def pending(self) -> int | None:
        """The step whose flags are posted and not taken yet, if any."""
        return self._step

    def post(self, step: int, flags: torch.Tensor) -> None:
        """Start copying ``step``'s flags ``[loss, non-finite, stop]`` to the host."""
        if self._step is not None:
            raise RuntimeError(f"step {self._step}'s flags were not taken before step {step}'s")
        self._host.copy_(flags.reshape(3), non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._step = step

    def take(self) -> tuple[int, list[float]] | None:
        """The posted step and its flags, or None: waits for the copy only (not for work queued
        after it), then reads host memory without a device op."""
        if self._step is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        step, self._step = self._step, None
        with host_tables():      # host memory: no device op (the counter's record of it)
            return step, self._host.numpy().tolist()
