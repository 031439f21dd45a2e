"""DiLoCo's outer step: the outer gradient is all-reduced, then a Nesterov outer update.

Spec (docs: /work/shared/spec/gasloc.md):

    delta = all_reduce_avg(theta0 - theta)      # outer gradient, kind "outer"
    b     = mu * b + delta     (b = delta at the first round)
    theta = theta0 - eta * (delta + mu * b)

computed in the spec's equivalent y form (``outer.py``): with ``y = theta0 - eta * delta`` and
``y_{-1} = theta_0``, ``theta = y + mu * (y - y_prev)``. Indeed ``y - y_prev = -eta * b`` round by
round, so both forms are the same update; the y form lets GASLoC on the complete graph run the very
same arithmetic. Replicas stay identical (every rank applies the same averaged delta).
"""

from __future__ import annotations

import torch

from .outer import OuterAlgorithm, extrapolate, outer_point


class DiLoCo(OuterAlgorithm):
    def round(self, t: int) -> dict[str, float]:
        st, dev = self.state, self.params[0].device
        delta = self.flat_like()
        offset = 0
        with torch.no_grad():
            for p, anchor in zip(self.params, st.anchor):
                delta[offset:offset + p.numel()].view_as(p).copy_(st.on(anchor, dev) - p)
                offset += p.numel()
            drift = float(torch.linalg.vector_norm(delta))
            self.comm.all_reduce(delta, kind="outer", average=True)
            out = delta  # overwritten piecewise with the new parameters below
            offset = 0
            for p, anchor, y_prev in zip(self.params, st.anchor, st.y_prev):
                d = delta[offset:offset + p.numel()].view_as(p)
                y = outer_point(st.on(anchor, dev), d, self.eta)
                x = extrapolate(y, st.on(y_prev, dev), self.gamma)
                y_prev.copy_(y)
                out[offset:offset + p.numel()].view_as(p).copy_(x)
                offset += p.numel()
            self.set_params(out)
        return {"outer/drift_norm": drift}
