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
``fp4_e2m1``). Every rank decodes the same bytes, so replicas stay identical; the rounding is
not fed back anywhere.
"""

from __future__ import annotations

from scape_train.comm import Handle
from ..scape.payload import PayloadCodec, all_reduce_mean
from .outer import OuterAlgorithm


class DiLoCo(OuterAlgorithm):
    all_reduce_kind = "outer"

    def __init__(self, params, names, comm, eta: float, gamma: float, on_cpu: bool, *,
                 payload_dtype: str = "fp32"):
        super().__init__(params, names, comm, eta, gamma, on_cpu)
        self.codec = PayloadCodec(payload_dtype)

    def average(self, delta, kind: str, async_op: bool) -> Handle:
        if not self.codec.lowp:
            return super().average(delta, kind, async_op)
        assert not async_op, "a quantized outer all-reduce blocks (validate refuses overlap)"
        mean, _ = all_reduce_mean(delta.float(), self.comm, self.codec, kind=kind)
        delta.copy_(mean)
        return Handle(self.comm, kind)          # done: nothing left in flight

    def round(self, t: int) -> dict[str, float]:
        return self.round_metrics(*self.all_reduce_round(kind=self.all_reduce_kind))
