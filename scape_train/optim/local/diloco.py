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
"""

from __future__ import annotations

from .outer import OuterAlgorithm


class DiLoCo(OuterAlgorithm):
    all_reduce_kind = "outer"

    def round(self, t: int) -> dict[str, float]:
        return self.round_metrics(*self.all_reduce_round(kind=self.all_reduce_kind))
