"""DiLoCo's outer step: the outer gradient is all-reduced, then a Nesterov outer update.

Spec (docs: /work/shared/spec/gasloc.md):

    delta = all_reduce_avg(theta0 - theta)      # outer gradient, kind "outer"
    b     = mu * b + delta     (b = delta at the first round)
    theta = theta0 - eta * (delta + mu * b)

computed in the spec's equivalent y form (``outer.py``): with ``y = theta0 - eta * delta`` and
``y_{-1} = theta_0``, ``theta = y + mu * (y - y_prev)``. Indeed ``y - y_prev = -eta * b`` round by
round, so both forms are the same update. The round is ``OuterAlgorithm.all_reduce_round``, which
complete-graph GASLoC runs too (bit-for-bit the same parameters). Replicas stay identical (every
rank applies the same averaged delta).

``payload_dtype`` (``strategy.outer_payload_dtype``) other than fp32 quantizes the all-reduce
with SCAPE's codecs (``optim/scape/payload.py``: an all-to-all of the coded chunks, a sum in
fp32, an all-gather of the coded means; Streaming DiLoCo's 4-bit outer gradients are
``fp4_e2m1``), ``chunk`` values at a time (``strategy.outer_payload_chunk``), so its temporaries
(26-32 bytes a value) are bounded by the chunk, not the model. Every rank decodes the same
bytes, so replicas stay identical. By default the rounding is dropped (Streaming DiLoCo's rule);
with ``error_feedback`` beta > 0 (``strategy.outer_error_feedback``) each worker keeps what its
rounds did not deliver, ``e``, and sends ``delta + beta * e`` next round:

    x = delta + beta * e;   avg, err = quantized_all_reduce_avg(x);   e <- err

``err`` is this worker's own rounding ``x - Q(x)`` plus, on the chunk it reduced, ``n`` times
the rounding of the mean (``payload.all_reduce_mean``), so with beta = 1 every worker's outer
gradient reaches the average in full, a round or more late (MuLoCo's and SparseLoCo's error
feedback, without their top-k).

Across torchft's replica groups (elastic), which carry no all-to-all, the quantized mean is an
all-gather of every worker's coded outer gradient, summed in fp32 by every worker alike
(``payload.all_gather_mean``: n/2 times the all-to-all form's bytes, no second rounding). A
round that does not commit puts ``e`` back as it was before the round: nobody applied it.
"""

from __future__ import annotations

import logging

import torch

from scape_train.comm import Comm, Handle
from scape_train.host_to_device import pinned_zeros
from ..scape.payload import PayloadCodec, quantized_mean
from .config import OUTER_PAYLOAD_CHUNK
from .outer import OuterAlgorithm, OuterState

log = logging.getLogger("scape_train")


def quantized_average_(delta: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str,
                       chunk: int, error: torch.Tensor | None = None,
                       error_feedback: float = 0.0) -> None:
    """``delta`` (1-D) replaced by its mean over the workers through ``codec``, ``chunk``
    values at a time; with ``error`` (fp32, ``delta``'s length, anywhere), ``error_feedback`` x
    ``error`` joins what is sent and ``error`` becomes what this round did not deliver. A group
    without an all-to-all gathers every worker's coded values instead (``payload.all_gather_mean``)."""
    device = delta.device
    for start in range(0, delta.numel(), chunk):
        part = delta[start:start + chunk]
        x = part.float()
        if error is not None:
            e = error[start:start + chunk]
            x = torch.add(x, OuterState.on(e, device), alpha=error_feedback)
        mean, err = quantized_mean(x, comm, codec, kind=kind)
        if error is not None:
            e.copy_(err)
        part.copy_(mean)
        del x, mean, err    # before the next chunk's: one chunk's temporaries at a time


class DiLoCo(OuterAlgorithm):
    all_reduce_kind = "outer"

    def __init__(self, params, names, comm, eta: float, gamma: float, on_cpu: bool, *,
                 payload_dtype: str = "fp32", payload_chunk: int = OUTER_PAYLOAD_CHUNK,
                 error_feedback: float = 0.0, rounds_can_fail: bool = False):
        super().__init__(params, names, comm, eta, gamma, on_cpu)
        self.codec = PayloadCodec(payload_dtype)
        self.payload_chunk, self.error_feedback = payload_chunk, error_feedback
        self.rounds_can_fail = rounds_can_fail      # elastic: e is copied aside until the vote
        self._error_before: torch.Tensor | None = None
        # what this worker's quantized rounds have not delivered yet, where the outer state is
        self.error = None
        if self.codec.lowp and error_feedback > 0:
            n = sum(p.numel() for p in params)
            if self.state.anchor[0].device == params[0].device:
                self.error = torch.zeros(n, dtype=torch.float32, device=params[0].device)
            else:   # outer_state_on_cpu: in host memory, pinned like theta0 and y_prev
                self.error = pinned_zeros((n,), torch.float32, self.state.anchor[0].is_pinned())

    def average(self, delta, kind: str, async_op: bool) -> Handle:
        if not self.codec.lowp:
            return super().average(delta, kind, async_op)
        assert not async_op, "a quantized outer all-reduce blocks (validate refuses overlap)"
        if self.error is not None and self.rounds_can_fail:
            self._error_before = self.error.clone()
        quantized_average_(delta, self.comm, self.codec, kind=kind, chunk=self.payload_chunk,
                           error=self.error, error_feedback=self.error_feedback)
        return Handle(self.comm, kind)          # done: nothing left in flight

    def apply_all_reduce(self, delta, local_weight: float = 0.0, local_delta=None) -> bool:
        committed = super().apply_all_reduce(delta, local_weight, local_delta)
        if self._error_before is not None:
            if not committed:          # nobody applied the round: e as if it had not been
                self.error.copy_(self._error_before)
            self._error_before = None
        return committed

    def round(self, t: int) -> dict[str, float]:
        return self.round_metrics(*self.all_reduce_round(kind=self.all_reduce_kind))

    def round_metrics(self, drift: float, committed: bool) -> dict[str, float]:
        metrics = super().round_metrics(drift, committed)
        if self.error is not None:
            metrics["outer/error_norm"] = float(torch.linalg.vector_norm(self.error))
        return metrics

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {} if self.error is None else {"outer_error": self.error}

    def load_extra_state(self, state: dict) -> None:
        if self.error is None:
            return
        saved = state.get("outer_error")
        if saved is None:
            log.warning("the checkpoint holds no outer error feedback (it was saved with "
                        "strategy.outer_error_feedback=0): it starts at zero")
            self.error.zero_()
        elif saved.numel() != self.error.numel():
            raise KeyError(f"the checkpoint's outer error feedback has {saved.numel()} values, "
                           f"this model's {self.error.numel()}: it was saved from another model "
                           "or fragment layout")
        else:
            self.error.copy_(saved)
