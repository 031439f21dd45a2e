"""The elastic rules in one process, without torchft: a round nobody commits changes nothing and
its drift joins the next one; a worker healing from a live peer takes the peer's committed point
and keeps its own drift; the default job does not import torchft."""

from __future__ import annotations

import copy
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
    """One process; ``commit`` answers from a script of votes (a lost peer's round: False); no
    all-to-all, as across torchft's replica groups."""

    offers_all_to_all = False

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


def test_quantized_outer_gradients_put_their_error_feedback_back_when_a_round_does_not_commit():
    """fp4 outer gradients with error feedback across replica groups (no all-to-all there: the
    all-gather form): a failed round leaves e as it was; a committed one delivers the drift and
    the e sent, less the e kept (one worker: to fp32's rounding)."""
    model, strat = make([False, True], slot=0, outer_payload_dtype="fp4_e2m1",
                        outer_error_feedback=1.0)
    outer = strat.outer
    outer.error.fill_(1e-3)          # as if earlier rounds had held some back
    before = outer.error.clone()
    drifts, drift_flat = [], outer.drift_flat
    outer.drift_flat = lambda: drifts.append(drift_flat()) or drifts[-1].clone()
    for s in range(2):
        inner_step(model, strat, s)
    assert strat.rounds_done == 0 and torch.equal(outer.error, before)   # the vote failed
    anchor = flat(outer.state.anchor).clone()
    for s in range(2, 4):
        inner_step(model, strat, s)
    assert strat.rounds_done == 1 and not torch.equal(outer.error, before)
    applied = (anchor - flat(outer.state.y_prev)).double() / 0.7      # y = theta0 - eta delta
    gap = applied - (drifts[-1].double() + before.double() - outer.error.double())
    assert gap.abs().max() < 1e-6, gap.abs().max()


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


def test_the_exchange_across_replica_groups_lives_on_the_workers_device(tmp_path):
    """The cross-group process group follows ``strategy.elastic.backend`` and the worker's
    device (NCCL on CUDA by default, gloo elsewhere), and its ``Comm`` takes the worker's device,
    so a GPU worker's tensors are exchanged where they live (``meta`` stands in for an
    accelerator here; nothing is exchanged)."""
    from scape_train.elastic.replica import ReplicaGroup, cross_group_backend, import_torchft

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cross_group_backend("auto", cuda) == "nccl" and cross_group_backend("auto", cpu) == "gloo"
    assert cross_group_backend("gloo", cuda) == "gloo"
    with pytest.raises(ValueError, match="backend=nccl needs CUDA"):
        cross_group_backend("nccl", cpu)
    import_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        cfg = ElasticConfig(enabled=True, lighthouse=server.address(), replica=0, slots=1)
        group = ReplicaGroup(cfg, tmp_path, dict, lambda state: None, device="meta")
        assert group.backend == "gloo" and group.comm.device == torch.device("meta")
        group.close()
        with pytest.raises(ValueError, match="backend=nccl needs CUDA"):
            ReplicaGroup(ElasticConfig(**{**cfg.__dict__, "backend": "nccl"}), tmp_path, dict,
                         lambda state: None, device="cpu")
    finally:
        server.shutdown()


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


# -- SCAPE across replica groups ---------------------------------------------------------------

SCAPE = dict(name="scape", lr=1e-2, clip_grad=1.0, density=0.25, density_warmup_steps=0)


def scape_model(hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def make_scape(votes, worker: int = 0, **cfg):
    from scape_train.optim import build_elastic_optimizer

    model = scape_model()
    return model, build_elastic_optimizer(OptimizerConfig(**{**SCAPE, **cfg}), model,
                                          VotingComm(votes), worker=worker)


def scape_backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()


def scape_state(strat) -> list[torch.Tensor]:
    """θ, m, this worker's residual and both masks: what a step changes."""
    s = strat.scape
    return [flat(s.layout.params), s.reference.state.m.clone(), s.reference.state.residual.full(),
            s.mask_cur.clone(), s.next_mask().clone()]


@pytest.mark.parametrize("payload", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_elastic_scape_step_that_does_not_commit_joins_the_next_as_a_micro_batch(impl, payload):
    """A failed step leaves θ, m, the residual, both masks and the step count as they were and
    keeps its gradient; the next committed step is SCAPE's step on the mean of both batches'
    gradients: bit for bit what plain SCAPE on one process does with a two-micro-batch
    gradient (the masks and residual at density 0.25 in play; fp8: the payload's rounding in
    the residual too, through the all-gather form on both)."""
    from scape_train.optim import build_optimizer

    model, strat = make_scape([True, True, False, True], scape_impl=impl, payload_dtype=payload)
    for s in range(2):
        scape_backward(model, s)
        strat.step(1e-2)
        strat.zero_grad()
    before = scape_state(strat)
    assert torch.count_nonzero(before[2]) > 0          # a residual to put back
    scape_backward(model, 2)
    assert strat.step(1e-2) == {}
    strat.zero_grad()
    for a, b in zip(scape_state(strat), before):
        assert torch.equal(a, b)
    assert strat.progress(3) == 2 and strat.attempts == 1
    scape_backward(model, 3)
    strat.step(1e-2)
    strat.zero_grad()
    assert strat.progress(4) == 3 and strat.attempts == 0

    ref_model = scape_model()
    ref = build_optimizer(OptimizerConfig(**{**SCAPE, "scape_impl": impl,
                                             "payload_dtype": payload}), ref_model, VotingComm([]))
    for s in range(2):
        scape_backward(ref_model, s)
        ref.step(1e-2)
        ref.zero_grad()
    scape_backward(ref_model, 2)
    scape_backward(ref_model, 3)
    for p in ref_model.parameters():
        p.grad.div_(2)
    ref.step(1e-2)
    wrapped = type("Wrapped", (), {"scape": ref})()
    for a, b in zip(scape_state(strat), scape_state(wrapped)):
        assert torch.equal(a, b)
    assert not torch.equal(scape_state(strat)[0], before[0])


def test_elastic_scape_heals_from_a_peer_with_a_zero_residual_and_resumes_its_own():
    """Healing takes a live peer's θ-independent state (momentum, masks, step) and restarts
    this worker's residual at zero (its own may be older than the quorum's point); loading this
    worker's own checkpoint keeps its residual."""
    peer_model, peer = make_scape([True] * 3, worker=1)
    for s in range(3):
        scape_backward(peer_model, 10 + s)
        peer.step(1e-2)
        peer.zero_grad()
    model, strat = make_scape([True], worker=0)
    scape_backward(model, 0)
    strat.step(1e-2)
    strat.zero_grad()
    own = copy.deepcopy(strat.checkpoint_state())     # as a checkpoint writer copies it
    own_residual = strat.scape.reference.state.residual.full()
    assert torch.count_nonzero(own_residual) > 0

    strat.load_checkpoint_state(peer.checkpoint_state())
    assert strat.progress(0) == 3 and strat.attempts == 0
    assert torch.equal(strat.scape.reference.state.m, peer.scape.reference.state.m)
    assert torch.equal(strat.scape.next_mask(), peer.scape.next_mask())
    assert torch.equal(strat.scape.mask_cur, peer.scape.mask_cur)
    assert torch.count_nonzero(strat.scape.reference.state.residual.full()) == 0

    _, restarted = make_scape([], worker=0)
    restarted.load_checkpoint_state(own)
    assert torch.equal(restarted.scape.reference.state.residual.full(), own_residual)


def test_elastic_scape_refuses_what_replica_groups_do_not_carry():
    from scape_train.optim import validate_elastic_optimizer

    for bad in (dict(sharded=True), dict(offload_residuals=True)):
        with pytest.raises(ValueError, match="replica groups"):
            validate_elastic_optimizer(OptimizerConfig(**{**SCAPE, **bad}))
    with pytest.raises(ValueError, match="not optimizer=powersgd"):
        validate_elastic_optimizer(OptimizerConfig(name="powersgd"))


class Quorums(Comm):
    """Gloo ranks standing in for replica groups whose quorum changes: :meth:`use` makes the
    collectives run over ``members`` only (a sub-group made beforehand on every rank), as a
    quorum that lost or regained workers; ``commit`` always holds; no all-to-all, as across
    torchft's replica groups."""

    offers_all_to_all = False

    def __init__(self, groups: dict[tuple[int, ...], object]):
        super().__init__()
        self.groups = groups
        self.backend = "torchft"                     # as ReplicaComm: refused nowhere

    def use(self, members: tuple[int, ...]) -> None:
        import torch.distributed as dist

        self.group = self.groups[members]
        self.rank, self.world = dist.get_rank(self.group), len(members)

    def all_to_all(self, *args, **kwargs):
        raise AssertionError("torchft's replica groups carry no all-to-all")


def _quorum_changes(rank: int, world: int, impl: str, payload: str):
    """Steps over the quorums (0, 1, 2) x3, (0, 1) x2, then 2 heals from 0 and (0, 1, 2) x2."""
    import torch.distributed as dist
    from scape_train.optim import build_elastic_optimizer

    groups = {(0, 1, 2): dist.group.WORLD, (0, 1): dist.new_group([0, 1])}
    comm = Quorums(groups)
    # 21 hidden units: the first matrix's top-k over 3 owners' pieces keeps 32 ones, over 2
    # owners' 33 (k = floor(d·numel) per piece), so a count taken from the schedule is wrong
    model = scape_model(21)
    strat = build_elastic_optimizer(OptimizerConfig(**{**SCAPE, "density": 0.1,
                                                       "scape_impl": impl,
                                                       "partitioner": "flat",
                                                       "payload_dtype": payload}),
                                    model, comm, worker=rank)
    step = 0
    for members, steps in (((0, 1, 2), 3), ((0, 1), 2), ((0, 1, 2), 2)):
        if members == (0, 1, 2) and step:            # worker 2 heals from worker 0
            comm.use(members)
            state = comm.broadcast_object(copy.deepcopy(strat.checkpoint_state()) if rank == 0
                                          else None, src=0)
            params = comm.broadcast_object(model.state_dict() if rank == 0 else None, src=0)
            if rank == 2:
                model.load_state_dict(params)
                strat.load_checkpoint_state(state)
        for _ in range(steps):
            step += 1
            if rank in members:
                comm.use(members)
                scape_backward(model, 100 * rank + step)
                strat.step(1e-2)
                strat.zero_grad()
        dist.barrier()
    return flat(model.parameters()), strat.progress(0)


@pytest.mark.parametrize("payload", ["fp32", "fp8_e4m3"])
def test_elastic_scape_through_quorums_of_3_2_3_keeps_workers_equal_and_engines_agreeing(payload):
    """The owners follow the quorum (flat partitioner: tensors cut between owners, so a mask
    built over 3 owners has other counts per segment over 2). Through quorums of 3, 2 and 3
    workers (the third healing from a peer), every worker ends on the same parameters, and the
    fused O(k) step, which walks the mask per segment, agrees with the reference step, which
    reads it whole; an fp8 payload goes through its all-gather form (no all-to-all here)."""
    from tests._dist import run_distributed

    ends = {impl: run_distributed(_quorum_changes, 3, (impl, payload))
            for impl in ("fused", "reference")}
    for impl, runs in ends.items():
        assert [steps for _, steps in runs] == [7, 7, 7], impl
        for params, _ in runs[1:]:
            assert torch.equal(params, runs[0][0]), impl
    torch.testing.assert_close(ends["fused"][0][0], ends["reference"][0][0], rtol=1e-5, atol=1e-7)
