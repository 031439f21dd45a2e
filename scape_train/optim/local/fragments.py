"""Streaming DiLoCo's fragments (Douillard et al., arXiv 2501.18512): the parameters split into F
parts, each synchronized on its own every H steps, one fragment every H/F steps, so a round moves
1/F of the model and the peak bandwidth falls F-fold.

    round t (every H/F inner steps) synchronizes fragment t mod F:
        delta_f = all_reduce_avg(theta0_f - theta_f)          its outer gradient, since its
                                                              last round H steps before
        y_f = theta0_f - eta * delta_f;  x_f = y_f + mu * (y_f - y_prev_f);  y_prev_f <- y_f
        theta0_f = theta_f = x_f                              the other fragments train on

Fragments are strided over the transformer blocks, as the paper found best: block i's tensors
belong to fragment i mod F. Every other tensor (embeddings, the final norm, the head) joins the
fragment that is smallest at that point, taken in name order, so the assignment depends on the
names and sizes alone (the memory plan computes the same one from a meta model).
"""

from __future__ import annotations

import re

from .diloco import DiLoCo
from .outer import OuterAlgorithm, OuterState, PendingRound

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fragments(names: list[str], numels: list[int], count: int) -> list[list[int]]:
    """The indices (into ``names``) of each of ``count`` fragments."""
    if count < 1:
        raise ValueError(f"fragments must be >= 1, got {count}")
    parts: list[list[int]] = [[] for _ in range(count)]
    sizes = [0] * count
    rest = []
    for i, name in enumerate(names):
        block = _BLOCK.search(name)
        if block is None:
            rest.append(i)
        else:
            f = int(block.group(1)) % count
            parts[f].append(i)
            sizes[f] += numels[i]
    for i in sorted(rest, key=lambda j: names[j]):
        f = min(range(count), key=lambda k: (sizes[k], k))
        parts[f].append(i)
        sizes[f] += numels[i]
    empty = [f for f, part in enumerate(parts) if not part]
    if empty:
        raise ValueError(f"strategy.fragments={count} leaves fragments {empty} without a tensor "
                         f"({len(names)} tensors): use fewer fragments")
    return [sorted(part) for part in parts]


class StreamingDiLoCo(OuterAlgorithm):
    """DiLoCo over one fragment per round: one :class:`DiLoCo` per fragment, each with its own
    outer state, sharing the communicator; round ``t`` is fragment ``t mod F``'s."""

    all_reduce_kind = "outer"
    round_sets_every_param = False    # the other fragments train on past their anchors

    def __init__(self, params, names, comm, eta: float, gamma: float, on_cpu: bool, *,
                 count: int, **diloco_options):
        self.params, self.comm, self.eta, self.gamma = params, comm, eta, gamma
        self.parts = fragments(names, [p.numel() for p in params], count)
        self.fragments = [DiLoCo([params[i] for i in part], [names[i] for i in part], comm, eta,
                                 gamma, on_cpu, **diloco_options)
                          for part in self.parts]
        # the whole outer state in the parameters' order: views of the fragments' own tensors,
        # so the strategy's checkpoint and a healing peer see one theta0 and y_prev per name
        anchor, y_prev = [None] * len(params), [None] * len(params)
        for part, frag in zip(self.parts, self.fragments):
            for j, i in enumerate(part):
                anchor[i], y_prev[i] = frag.state.anchor[j], frag.state.y_prev[j]
        self.state = OuterState.of(names, anchor, y_prev)
        self.in_flight = 0          # the fragment of the round last started (overlapped rounds)

    def fragment_of(self, t: int) -> DiLoCo:
        return self.fragments[t % len(self.fragments)]

    def round(self, t: int) -> dict[str, float]:
        return {**self.fragment_of(t).round(t), "outer/fragment": float(t % len(self.fragments))}

    def start_round(self, t: int, keep_local: bool) -> tuple[PendingRound, dict[str, float]]:
        self.in_flight = t % len(self.fragments)
        pending, metrics = self.fragment_of(t).start_round(t, keep_local)
        return pending, {**metrics, "outer/fragment": float(self.in_flight)}

    def land(self, pending: PendingRound, local_weight: float) -> None:
        self.fragments[self.in_flight].land(pending, local_weight)

    def extra_state(self) -> dict:
        errors = {f"fragment_{f}": frag.extra_state() for f, frag in enumerate(self.fragments)}
        return {"fragment_in_flight": self.in_flight,
                **{key: part for key, part in errors.items() if part}}

    def load_extra_state(self, state: dict) -> None:
        self.in_flight = int(state.get("fragment_in_flight", 0))
        for f, frag in enumerate(self.fragments):
            frag.load_extra_state(state.get(f"fragment_{f}", {}))
