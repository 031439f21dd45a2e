"""The elastic rules in one process, without torchft: a round nobody commits changes nothing and
its drift joins the next one; a worker healing from a live peer takes the peer's committed point
and keeps its own drift; the default job does not import torchft."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from scape_train.comm import Comm
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.local import build_local_strategy
from scape_train.optim.local.config import ElasticConfig, StrategyConfig


class VotingComm(Comm):
    """One process; ``commit`` answers from a script of votes (a lost peer's round: False)."""

    def __init__(self, votes: list[bool]):
        super().__init__()
        self.votes = list(votes)

    def commit(self) -> bool:
        return self.votes.pop(0)


def make(votes, slot: int, h: int = 2, name: str = "diloco", **strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = StrategyConfig(name=name, inner_steps=h, **strategy,
                         elastic=ElasticConfig(enabled=True, replica=slot, slots=4))
    return model, build_local_strategy(cfg, OptimizerConfig(name="adamw", lr=1e-2), model,
                                       VotingComm(votes))


def inner_step(model, strategy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    model(x).pow(2).mean().backward()
    strategy.step(1e-2)
    strategy.zero_grad()


def flat(ps) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ps])


def test_a_round_that_does_not_commit_is_applied_by_nobody_and_its_drift_carries_over():
    model, strat = make([False, True], slot=0)
    anchor0 = flat(strat.outer.state.anchor).clone()
    y_prev0 = flat(strat.outer.state.y_prev).clone()
    for s in range(2):
        inner_step(model, strat, s)
    theta = flat(strat.params).clone()
    assert strat.rounds_done == 0 and strat.uncommitted_steps == 2     # round 1 failed
    assert torch.equal(flat(strat.outer.state.anchor), anchor0)
    assert torch.equal(flat(strat.outer.state.y_prev), y_prev0)
    assert not torch.equal(theta, anchor0)                             # the worker kept theta
    assert "params" in strat.checkpoint_state().per_rank               # and checkpoints it
    for s in range(2, 4):
        inner_step(model, strat, s)
    assert strat.rounds_done == 1 and strat.uncommitted_steps == 0
    # the committed round's outer gradient is the drift of all four inner steps (world of one:
    # theta = y + mu (y - y_prev) with y = theta0 - eta * (theta0 - theta_4))
    assert torch.equal(flat(strat.params), flat(strat.outer.state.anchor))


def test_sparseloco_puts_its_error_feedback_back_when_a_round_does_not_commit():
    """A failed round leaves nothing behind: with H = 2 and the first round's vote failed, the
    worker after 4 steps holds exactly what one committed round of H = 4 over the same steps
    gives (the same theta, theta0 and error feedback e = beta * 0 + delta - s, bit for bit).
    Without the restore e would hold the failed round's drift twice."""
    sparse = dict(sparse_chunk=8, sparse_topk=2, outer_lr=1.0, outer_momentum=0.0)
    model, strat = make([False, True], slot=0, h=2, name="sparseloco", **sparse)
    for s in range(2):
        inner_step(model, strat, s)
    assert strat.rounds_done == 0 and torch.count_nonzero(strat.outer.error) == 0
    for s in range(2, 4):
        inner_step(model, strat, s)
    ref_model, ref = make([True], slot=0, h=4, name="sparseloco", **sparse)
    for s in range(4):
        inner_step(ref_model, ref, s)
    assert strat.rounds_done == ref.rounds_done == 1
    assert torch.count_nonzero(ref.outer.error) > 0
    assert torch.equal(strat.outer.error, ref.outer.error)
    assert torch.equal(flat(strat.params), flat(ref.params))
    assert torch.equal(flat(strat.outer.state.anchor), flat(ref.outer.state.anchor))


def test_healing_takes_the_peers_committed_point_and_keeps_the_own_drift():
    peer_model, peer = make([True, True], slot=1)
    for s in range(4):                       # two committed rounds
        inner_step(peer_model, peer, 100 + s)
    state = peer.checkpoint_state().per_rank

    model, strat = make([False], slot=0)     # a survivor whose round failed
    for s in range(2):
        inner_step(model, strat, s)
    drift = flat(strat.params) - flat(strat.outer.state.anchor)
    inner = {k: v.clone() for k, v in strat.optimizer.state[strat.params[0]].items()}
    strat.load_checkpoint_state(type(peer.checkpoint_state())(per_rank=state))
    assert strat.rounds_done == peer.rounds_done == 2
    assert torch.equal(flat(strat.outer.state.anchor), flat(peer.outer.state.anchor))
    assert torch.equal(flat(strat.outer.state.y_prev), flat(peer.outer.state.y_prev))
    torch.testing.assert_close(flat(strat.params), flat(peer.outer.state.anchor) + drift)
    assert strat.uncommitted_steps == 2
    for k, v in inner.items():               # its own inner state, the one its drift came from
        assert torch.equal(strat.optimizer.state[strat.params[0]][k], v)

    _, fresh = make([], slot=2)              # a restarted process: no drift, the peer's all
    fresh.load_checkpoint_state(type(peer.checkpoint_state())(per_rank=state))
    assert torch.equal(flat(fresh.params), flat(peer.outer.state.anchor))
    assert fresh.uncommitted_steps == 0
    assert torch.equal(fresh.optimizer.state[fresh.params[0]]["exp_avg"],
                       peer.optimizer.state[peer.params[0]]["exp_avg"])


def test_the_default_job_does_not_import_torchft():
    code = ("import sys, scape_train.train, scape_train.optim.local, scape_train.comm; "
            "print('torchft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def make_dense(votes, optimizer: str = "adamw"):
    from scape_train.optim.elastic_dense import ElasticDenseStrategy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = OptimizerConfig(name=optimizer, lr=1e-2, clip_grad=1.0)
    return model, ElasticDenseStrategy(cfg, model, VotingComm(votes))


def backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 4, generator=g)).pow(2).mean().backward()


@pytest.mark.parametrize("optimizer", ["adamw", "adams"])
def test_elastic_dense_step_that_does_not_commit_joins_the_next_as_a_micro_batch(optimizer):
    """A failed step changes nothing and keeps its gradient; the next committed step updates
    with the mean of both batches' gradients: exactly the dense step of a two-micro-batch
    gradient (torch's DenseStrategy on one process, the same clipping)."""
    from scape_train.optim.dense import DenseStrategy

    model, strat = make_dense([False, True], optimizer)
    before = flat(strat.params).clone()
    backward(model, 0)
    strat.step(1e-2)
    strat.zero_grad()
    assert torch.equal(flat(strat.params), before) and strat.progress(1) == 0
    assert strat.params[0].grad is not None            # kept for the next step
    backward(model, 1)
    strat.step(1e-2)
    strat.zero_grad()
    assert strat.progress(2) == 1 and strat.params[0].grad is None

    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = DenseStrategy(OptimizerConfig(name=optimizer, lr=1e-2, clip_grad=1.0), ref_model,
                        adams=optimizer == "adams")
    backward(ref_model, 0)
    backward(ref_model, 1)
    for p in ref.params:
        p.grad.div_(2)
    ref.step(1e-2)
    assert torch.equal(flat(strat.params), flat(ref.params))
    assert not torch.equal(flat(strat.params), before)


def test_elastic_dense_heals_to_the_peers_state_and_drops_its_failed_steps():
    peer_model, peer = make_dense([True, True])
    for s in range(2):
        backward(peer_model, 10 + s)
        peer.step(1e-2)
        peer.zero_grad()
    model, strat = make_dense([False])
    backward(model, 0)
    strat.step(1e-2)
    strat.zero_grad()
    strat.load_checkpoint_state(peer.checkpoint_state())
    assert strat.progress(0) == 2 and strat.attempts == 0
    assert all(p.grad is None for p in strat.params)
    state = strat.optimizer.state[strat.params[0]]
    assert torch.equal(state["exp_avg"], peer.optimizer.state[peer.params[0]]["exp_avg"])


def test_streaming_diloco_retries_the_fragment_whose_round_did_not_commit():
    """Fragments under elastic rounds: a failed round of fragment 0 changes nothing, and the next
    round is fragment 0's again (round t is fragment t mod F, t counting committed rounds)."""
    model, strat = make([False, True, True], slot=0, h=4, fragments=2)
    anchor0 = flat(strat.outer.state.anchor).clone()
    rounds = []
    for s in range(6):                     # a round every 2 steps: fails, commits, commits
        inner_step(model, strat, s)
        rounds.append(strat._last_round.get("outer/fragment"))
    assert rounds[1::2] == [0.0, 0.0, 1.0] and strat.rounds_done == 2
    assert not torch.equal(flat(strat.outer.state.anchor), anchor0)
