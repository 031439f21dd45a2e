"""The trainer's view of DiLoCo / GASLoC: inner steps through ``step(lr)``, an outer round at the end.

Each ``step(lr)`` is one inner step of a local, non-communicating optimizer (AdamW or AdamS, clip
``clip_grad``; its state is never reset between rounds). A round ends

- after ``H_i`` inner steps (``inner_steps``, or this rank's entry of ``inner_steps_per_worker``;
  ``H_i = 0``: the worker discards its gradient and only mixes), or
- at the run's end: the last round stops where the nominal step (below) reaches
  ``total_steps``, so a run of T steps trains T steps whether or not H divides T, or
- with ``round_budget_s > 0``, when another inner step would overrun the wall-clock budget. The
  budget runs from the start of the previous exchange, so a worker whose exchange was slow (a
  bandwidth straggler, or a peer of one) or whose steps are slow takes fewer inner steps and
  arrives at the next exchange with the others. At least one inner step per round.

Then the outer algorithm (``diloco.py`` all-reduce, or ``gasloc.py`` gossip) runs. With
``overlap_steps`` tau > 0 the round's exchange (the all-reduce, or the gossip exchange) is
started, not waited for: the worker takes tau inner steps of the next round from where it is,
then the exchange lands: theta0 moves to the new outer point x (DiLoCo's outer step on the
average; gossip: the mix of the peers' points), and theta moves by what x moved the round's end
point (``overlap_merge=carry``: the tau steps kept whole) or becomes
``alpha * theta + (1 - alpha) * x`` (``mix``, ``overlap_local_weight`` alpha). The run's last round
blocks, so a run ends on the outer point; a checkpoint taken while an exchange is in flight
waits for it and saves its result (the average, or the mixed point), which lands tau steps after
the resume as it would have.

A round that does not commit (elastic runs: a participant was lost, ``Comm.commit``) is applied
by nobody: this worker keeps theta and its inner state, and its drift since the last committed
round joins the next one (``uncommitted_steps`` counts its inner steps). The trainer makes
no per-step collective (``synchronous = False``); ``progress`` tells it where rounds end: every
worker ends round r at its own local step, and there ``progress`` returns the nominal step on
all of them: ``r * H``, the last round's shorter length counted as it is (``None`` in between),
which is where the trainer validates, checkpoints and stops. A run resumed with a larger
``trainer.max_steps`` goes on from that step in rounds of H.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from ..base import OptimizerStrategy, set_lr
from scape_train.comm import Comm
from ..config import OptimizerConfig
from ..dense import build_local_optimizer, grad_norm_and_clip, load_named_state_dict, named_state_dict
from ..state import StateParts
from .config import StrategyConfig
from .outer import OuterAlgorithm, PendingRound, snapshot


def _snapshot_tree(obj: Any) -> Any:
    """The optimizer state with every tensor copied to host memory (later steps mutate it)."""
    if isinstance(obj, torch.Tensor):
        return snapshot(obj)
    if isinstance(obj, dict):
        return {k: _snapshot_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot_tree(v) for v in obj]
    return copy.deepcopy(obj)


class LocalStepStrategy(OptimizerStrategy):
    synchronous = False
    state_holds_params = True

    def __init__(self, cfg: StrategyConfig, optimizer_cfg: OptimizerConfig, model: nn.Module,
                 comm: Comm, make_outer, total_steps: int = 0, broadcast_initial: bool = True):
        """``make_outer(params, names) -> OuterAlgorithm`` builds DiLoCo, GASLoC or SparseLoCo;
        ``total_steps``: the run's length (0: no end to fit the last round to);
        ``broadcast_initial``: rank 0's parameters to every rank first (off where a checkpoint
        is loaded next)."""
        self.cfg, self.opt_cfg, self.comm = cfg, optimizer_cfg, comm
        self.optimizer, index_names = build_local_optimizer(optimizer_cfg, model,
                                                            adams=optimizer_cfg.name == "adams")
        self._names = index_names
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        names = [index_names[i] for i in range(len(self.params))]
        if broadcast_initial:
            self._broadcast_initial(self.params)   # all theta^i_0 equal
        self.outer: OuterAlgorithm = make_outer(self.params, names)
        self.param_names = names
        per_worker = list(cfg.inner_steps_per_worker)
        # Streaming DiLoCo (fragments F): a round every H/F steps, each of one fragment
        self.h_local = per_worker[comm.rank] if per_worker else cfg.inner_steps // cfg.fragments
        self.nominal_h = max(cfg.inner_steps // cfg.fragments, 1)   # the steps a round stands for
        self.total_steps = total_steps
        self.budget_s = float(cfg.round_budget_s)
        # whose state this is: the elastic replica slot, else the rank. Another worker's state
        # (a replica healing from a live peer) is taken at its last committed round.
        self.owner = cfg.elastic.replica if cfg.elastic.enabled else comm.rank
        self.rounds_done = 0            # committed rounds
        self.nominal_step = 0           # the step they stand for (H each; the last one less)
        self.steps_in_round = 0
        self.uncommitted_steps = 0      # inner steps whose drift no committed round holds yet
        self.local_step = 0          # the trainer's step count on this worker
        self.sync_step = 0           # local_step at the end of the last round
        self._step_hint: int | None = None
        self._clock: float | None = None      # budget: start of the previous exchange
        self._last_mark: float | None = None  # budget: end of the previous inner step
        self._last_round: dict[str, float] = {}
        self.overlap, self.local_weight = cfg.overlap_steps, cfg.overlap_local_weight
        self.carry = cfg.overlap_merge == "carry"
        # an overlapped round's exchange in flight, landing `overlap` inner steps later
        self._pending: PendingRound | None = None

    def _broadcast_initial(self, params: list[torch.Tensor]) -> None:
        if self.comm.world <= 1:
            return
        with torch.no_grad():
            for p in params:
                self.comm.broadcast(p.data, src=0, kind="params")

    # -- the trainer's hooks ---------------------------------------------------------------
    def progress(self, step: int) -> int | None:
        return self.nominal_step if step == self.sync_step else None

    def _steps_left(self) -> int | None:
        """Nominal steps from this round's start to the run's end (None: no end given)."""
        return self.total_steps - self.nominal_step if self.total_steps else None

    def before_forward(self, step: int) -> None:
        self._step_hint = step
        if self._clock is None:
            self._clock = self._last_mark = time.perf_counter()

    def step(self, lr: float) -> dict[str, float]:
        self.local_step = self._step_hint if self._step_hint is not None else self.local_step + 1
        self._step_hint = None
        metrics: dict[str, float] = {}
        if self.budget_s > 0 or self.h_local > 0:
            set_lr(self.optimizer, lr)
            metrics["grad_norm"] = grad_norm_and_clip(self.params, self.opt_cfg.clip_grad,
                                                      self.opt_cfg.foreach)
            self.optimizer.step()
            self.steps_in_round += 1
            self.uncommitted_steps += 1
        if self._pending is not None and self.steps_in_round >= self.overlap:
            self._land()
        if self._round_over():
            self._last_round = self._end_round()
        # The last finished round's figures on every step: the trainer logs every log_every
        # steps, which need not fall on a round end.
        metrics.update(self._last_round)
        return metrics

    def _round_over(self) -> bool:
        left = self._steps_left()
        if left is not None and 0 < left <= self.steps_in_round:
            return True       # the run's last round, shorter than H
        if self.budget_s <= 0:
            return self.steps_in_round >= self.h_local
        now = time.perf_counter()
        if self._clock is None:
            self._clock = self._last_mark = now
        step_s = now - self._last_mark
        self._last_mark = now
        return now - self._clock + step_s >= self.budget_s

    def _end_round(self) -> dict[str, float]:
        start = time.perf_counter()
        left = self._steps_left()
        length = min(self.nominal_h, left) if left is not None and left > 0 else self.nominal_h
        if self._pending is not None:   # a round no longer than the overlap: the last one lands
            self._land()
        last = left is not None and left <= self.nominal_h
        if self.overlap and not last:   # lands after `overlap` inner steps of the next round
            self._pending, metrics = self.outer.start_round(self.rounds_done, keep_local=self.carry)
        else:
            metrics = self.outer.round(self.rounds_done)
        metrics["outer/inner_steps"] = float(self.steps_in_round)
        if metrics.get("outer/committed", 1.0) > 0:
            self.rounds_done += 1
            self.nominal_step += length
            self.uncommitted_steps = 0
        metrics["outer/round"] = float(self.rounds_done)
        self.steps_in_round = 0
        self.sync_step = self.local_step
        self._clock, self._last_mark = start, time.perf_counter()
        return metrics

    def _land(self) -> None:
        """The overlapped round's exchange: waited for now, then its outer step."""
        pending, self._pending = self._pending, None
        self.outer.land(pending, self.local_weight)

    def close(self) -> None:
        """Wait for an exchange still in flight (a run stopped between a round's end and its
        landing): the peers' sends must complete before the process group goes."""
        if self._pending is not None:
            self._pending.result()

    def _pending_state(self) -> dict[str, torch.Tensor]:
        """The in-flight exchange's result, waited for (a checkpoint saves it whole: an average
        of drifts, or a gossip round's mixed point), and (carry) this worker's own delta of that
        round."""
        return {} if self._pending is None else self._pending.state()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """:meth:`checkpoint_state`'s pieces with every tensor copied to host memory (later steps
        mutate the live ones)."""
        return _snapshot_tree(self.checkpoint_state().per_rank)

    def checkpoint_state(self) -> StateParts:
        """All per rank: each worker's inner optimizer state (and, under GASLoC, its replica and
        outer state) is its own. Live tensors, no snapshots: the save writes them at once."""
        st = self.outer.state
        state: dict[str, Any] = {
            "optimizer": named_state_dict(self.optimizer, self._names),
            "outer": {"anchor": dict(zip(st.names, st.anchor)),
                      "y_prev": dict(zip(st.names, st.y_prev)), **self.outer.extra_state()},
            "rounds_done": self.rounds_done, "nominal_step": self.nominal_step,
            "steps_in_round": self.steps_in_round,
            "local_step": self.local_step, "sync_step": self.sync_step,
            "uncommitted_steps": self.uncommitted_steps, "owner": self.owner,
            "last_round": dict(self._last_round),
        }
        # After a committed round theta == theta0 (saved as the anchor); mid-round, after a
        # round that did not commit, with overlapped rounds, or where a round sets one fragment
        # only, this worker's own theta is needed too (the checkpoint's model file holds rank
        # 0's replica only).
        if self.uncommitted_steps > 0 or self.overlap or not self.outer.round_sets_every_param:
            state["params"] = {n: p.detach() for n, p in zip(self.param_names, self.params)}
        state.update(self._pending_state())
        return StateParts(per_rank=state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This worker's state, or another worker's (``owner`` differs: a worker healing from a
        live peer). From another worker it takes the committed point (theta0, y_prev, the
        round counters) and keeps its own drift since its last committed round, which joins the
        next round (zero for a restarted process), with its own inner optimizer state where it
        has one."""
        foreign = state.get("owner", self.owner) != self.owner
        own_drift = None
        if foreign and self.uncommitted_steps > 0:
            with torch.no_grad():
                own_drift = [p - self.outer.state.on(a, p.device)
                             for p, a in zip(self.params, self.outer.state.anchor)]
        if not (foreign and own_drift is not None):
            load_named_state_dict(self.optimizer, state["optimizer"], self._names)
        self.outer.state.load_state_dict(state["outer"])
        if not foreign:   # a worker's own error feedback (SparseLoCo) is never another's
            self.outer.load_extra_state(state["outer"])
        self.rounds_done = int(state["rounds_done"])
        self.nominal_step = int(state.get("nominal_step", self.rounds_done * self.nominal_h))
        self.steps_in_round = int(state["steps_in_round"])
        self.local_step = int(state["local_step"])
        self.sync_step = int(state["sync_step"])
        self._last_round = dict(state.get("last_round", {}))   # logged until the next round ends
        source = state.get("params")
        if foreign:
            source, self.steps_in_round = None, 0
            self.local_step = self.sync_step
            if own_drift is None:
                self.uncommitted_steps = 0
        else:
            self.uncommitted_steps = int(state.get("uncommitted_steps", state["steps_in_round"]))
        source = source or dict(zip(self.param_names, self.outer.state.anchor))
        with torch.no_grad():
            for i, (n, p) in enumerate(zip(self.param_names, self.params)):
                p.copy_(source[n])   # this worker's own replica (GASLoC replicas differ)
                if own_drift is not None:
                    p.add_(own_drift[i])
        # an overlapped round's result (and own delta), landing later
        self._pending = PendingRound.from_state(state, self.params[0].device)
        self._clock = self._last_mark = None
