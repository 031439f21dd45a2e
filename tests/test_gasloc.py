"""DiLoCo and GASLoC on real gloo processes: the spec's equations and invariants
(/work/shared/spec/gasloc.md), byte counts, heterogeneity, exact resume and one trainer run."""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scape_train.comm import Comm, ring_all_reduce_bytes
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.local import StrategyConfig, build_local_strategy, validate
from scape_train.optim.local.config import ElasticConfig
from scape_train.optim.local.diloco import DiLoCo
from scape_train.optim.local.gasloc import GASLoC
from scape_train.optim.local.topology import mixing_matrix, peers
from tests._dist import run_distributed
from tests._optim_common import batch, flat_params, loss_fn, tiny_model
from tests.helpers import assert_same_record, total_sent_bytes

SHAPES = [(4, 5), (7,), (3, 3)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


# -- the outer step on random tensors, against the spec's formulas in float64 ------------------
def _noise(rank: int, t: int) -> list[torch.Tensor]:
    """Worker ``rank``'s inner-step drift in round ``t`` (every rank can recompute anyone's)."""
    g = torch.Generator().manual_seed(7919 * t + rank)
    return [0.1 * torch.randn(s, generator=g) for s in SHAPES]


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _reference(algo: str, n: int, rounds: int, eta: float, gamma: float, topology: str = "complete",
               seed: int = 0, idle: tuple[int, ...] = ()) -> list[list[torch.Tensor]]:
    """All workers' flat parameters after each round, from the spec's equations in float64.
    DiLoCo in its b form (outer momentum buffer), GASLoC in its y form. ``idle`` workers: H_i = 0."""
    theta = [_flat(_initial()).double() for _ in range(n)]
    y_prev = [t.clone() for t in theta]
    b = None
    out = []
    for t in range(rounds):
        end = [theta[i] if i in idle else theta[i] + _flat(_noise(i, t)).double() for i in range(n)]
        if algo == "diloco":
            delta = sum(theta[i] - end[i] for i in range(n)) / n
            b = delta if b is None else gamma * b + delta
            theta = [theta[0] - eta * (delta + gamma * b) for _ in range(n)]
        else:
            y = [theta[i] + eta * (end[i] - theta[i]) for i in range(n)]
            x = [y[i] + gamma * (y[i] - y_prev[i]) for i in range(n)]
            y_prev = y
            w = mixing_matrix(topology, n, t, seed)
            theta = [sum(w[i, j] * x[j] for j in range(n)) for i in range(n)]
        out.append([th.clone() for th in theta])
    return out


def _outer_worker(rank, world, algo, rounds, eta, gamma, topology, idle):
    params = [nn.Parameter(t) for t in _initial()]
    comm = Comm()
    names = [f"p{i}" for i in range(len(params))]
    if algo == "diloco":
        outer = DiLoCo(params, names, comm, eta, gamma, on_cpu=False)
    else:
        outer = GASLoC(params, names, comm, eta, gamma, on_cpu=False, topology=topology, seed=0)
    history, stats, drifts, sent_means = [], [], [], []
    for t in range(rounds):
        with torch.no_grad():
            if rank not in idle:
                for p, d in zip(params, _noise(rank, t)):
                    p.add_(d)
        comm.pop_stats()
        if algo == "gasloc":  # the two halves of round(), to see what was sent (x) and the mix
            with torch.no_grad():
                send, _, drift = outer._local_points()
                mixed, _ = outer.mix(send, t)
                outer._advance()
                outer.set_params(mixed)
            gathered = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(gathered, send)
            sent_means.append(torch.stack(gathered).double().mean(0))
            metrics = {"outer/drift_norm": drift}
        else:
            metrics = outer.round(t)
        stats.append(comm.pop_stats())
        drifts.append(metrics["outer/drift_norm"])
        history.append(_flat(params).detach().clone())
    return history, stats, drifts, sent_means


def test_diloco_follows_the_spec_equations_and_counts_outer_bytes():
    n, rounds, eta, mu = 3, 4, 0.7, 0.9
    res = run_distributed(_outer_worker, n, ("diloco", rounds, eta, mu, "complete", ()))
    ref = _reference("diloco", n, rounds, eta, mu)
    for rank, (history, stats, drifts, _) in enumerate(res):
        for t in range(rounds):
            torch.testing.assert_close(history[t].double(), ref[t][rank], rtol=0, atol=1e-5)
            assert torch.equal(history[t], res[0][0][t])      # replicas stay identical
            assert stats[t]["comm/outer_sent_bytes"] == ring_all_reduce_bytes(NUMEL * 4, n)
            assert drifts[t] > 0


@pytest.mark.parametrize("topology", ["2peer", pytest.param("1peer", marks=pytest.mark.slow)])
def test_gasloc_follows_the_spec_preserves_the_mean_and_only_gossips(topology):
    n, rounds, eta, gamma = 4, 5, 0.7, 0.9
    res = run_distributed(_outer_worker, n, ("gasloc", rounds, eta, gamma, topology, (2,)))
    ref = _reference("gasloc", n, rounds, eta, gamma, topology, idle=(2,))
    for t in range(rounds):
        w = mixing_matrix(topology, n, t, 0)
        new_mean = torch.stack([res[r][0][t] for r in range(n)]).double().mean(0)
        # gossip preserves the mean: mean_i theta_{t+1} = mean_i x_i
        torch.testing.assert_close(new_mean, res[0][3][t], rtol=0, atol=1e-6)
        for rank in range(n):
            history, stats, drifts, _ = res[rank]
            torch.testing.assert_close(history[t].double(), ref[t][rank], rtol=0, atol=1e-5)
            # point-to-point only: parameters x 4 bytes x peers sent to, and no collective kind
            assert {k.split("/")[1].rsplit("_", 2)[0] for k in stats[t]
                    if k.endswith("_sent_bytes")} == {"gossip"}
            assert stats[t]["comm/gossip_sent_bytes"] == NUMEL * 4 * len(peers(w, rank))
            assert stats[t]["comm/gossip_recv_bytes"] == NUMEL * 4 * len(peers(w, rank))
            assert (drifts[t] == 0.0) == (rank == 2)          # H_i = 0: zero drift, only mixes
    replicas = torch.stack([res[r][0][-1] for r in range(n)])
    assert (replicas - replicas.mean(0)).abs().max() > 0      # sparse graph: replicas differ


@pytest.mark.slow
def test_gamma0_eta1_is_the_plain_gossip_average_of_end_points():
    n, rounds = 4, 3
    res = run_distributed(_outer_worker, n, ("gasloc", rounds, 1.0, 0.0, "2peer", ()))
    theta = [_flat(_initial()) for _ in range(n)]
    for t in range(rounds):
        ends = [theta[i] + _flat(_noise(i, t)) for i in range(n)]
        w = mixing_matrix("2peer", n, t, 0)
        for i in range(n):
            expected = sum(float(w[i, j]) * ends[j].double() for j in range(n))
            torch.testing.assert_close(res[i][0][t].double(), expected, rtol=0, atol=1e-6)
            torch.testing.assert_close(res[i][3][t], torch.stack(ends).double().mean(0), rtol=0,
                                       atol=1e-6)   # x_i is the end point itself
        theta = [res[i][0][t] for i in range(n)]


# -- the strategy the trainer drives ------------------------------------------------------------
OPT = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, clip_grad=1.0)


def _make(cfg: StrategyConfig, seed: int = 0):
    model = tiny_model(seed)
    return build_local_strategy(cfg, OPT, model, Comm()), model


def _steps(strategy, model, first: int, last: int, data_rank: int, lr: float = 1e-2,
           slow_s: float = 0.0) -> list[dict]:
    out = []
    for step in range(first, last + 1):
        strategy.before_forward(step)
        x, y = batch(step, data_rank)
        loss_fn(model, x, y).backward()
        if slow_s:
            time.sleep(slow_s)
        strategy.after_backward()
        metrics = strategy.step(lr)
        strategy.zero_grad()
        out.append({"step": step, "progress": strategy.progress(step), **metrics})
    return out


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


def _complete_graph_worker(rank, world):
    """DiLoCo and complete-graph GASLoC from the same start, 4 rounds of H = 3 real AdamW steps,
    with the same data on every rank and with each rank's own data: every tensor after every
    round, the bytes each round counted, and (own data) a run resumed mid-round."""
    base = dict(topology="complete", inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    result = {}
    for data in ("same", "own"):
        data_rank = 0 if data == "same" else rank
        for name in ("diloco", "gasloc"):
            strategy, model = _make(StrategyConfig(name=name, **base))
            strategy.comm.pop_stats()                   # the initial broadcast (kind params)
            rounds, stats = [], []
            for r in range(4):
                _steps(strategy, model, 3 * r + 1, 3 * r + 3, data_rank)
                stats.append(strategy.comm.pop_stats())
                rounds.append([p.detach().clone() for p in model.parameters()])
            result[data, name] = {"rounds": rounds, "stats": stats}
            if data == "own":   # exact resume mid-round: 7 steps, state into fresh objects, 5 more
                first, m1 = _make(StrategyConfig(name=name, **base))
                _steps(first, m1, 1, 7, data_rank)
                buf = io.BytesIO()
                torch.save(first.state_dict(), buf)
                buf.seek(0)
                second, m2 = _make(StrategyConfig(name=name, **base), seed=123)
                second.load_state_dict(torch.load(buf, weights_only=True))
                _steps(second, m2, 8, 12, data_rank)
                result[data, name]["resumed"] = [p.detach().clone() for p in m2.parameters()]
    # the ablation (mix y, momentum after) is not DiLoCo: it keeps the point-to-point mix
    strategy, model = _make(StrategyConfig(name="gasloc", mix_momentum=False, **base))
    strategy.comm.pop_stats()
    _steps(strategy, model, 1, 3, rank)
    result["ablation_stats"] = strategy.comm.pop_stats()
    return result


def _sent_kinds(stats: dict) -> set[str]:
    return {k[len("comm/"):-len("_sent_bytes")] for k in stats
            if k.endswith("_sent_bytes") and k != "comm/sent_bytes"}


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3,
                               pytest.param(4, marks=pytest.mark.slow),
                               pytest.param(5, marks=pytest.mark.slow)])
def test_complete_graph_gasloc_is_diloco_bit_for_bit(n):
    # n = 3 and 5: 1/n is not exact in binary; "own": each rank its own data, so the drifts differ
    res = run_distributed(_complete_graph_worker, n)
    nbytes = sum(p.numel() for p in tiny_model().parameters()) * 4
    for data in ("same", "own"):
        cases, differ, worst = 0, [], 0.0
        for rank in range(n):
            diloco, gasloc = res[rank][data, "diloco"], res[rank][data, "gasloc"]
            for r, (dr, gr) in enumerate(zip(diloco["rounds"], gasloc["rounds"])):
                for i, (d, g) in enumerate(zip(dr, gr)):
                    cases += 1
                    if not torch.equal(d, g):
                        differ.append((rank, r, i))
                        worst = max(worst, float((d - g).abs().max()))
                    # replicas stay identical: every rank holds rank 0's bits
                    assert torch.equal(g, res[0][data, "gasloc"]["rounds"][r][i])
                    assert torch.equal(d, res[0][data, "diloco"]["rounds"][r][i])
        assert not differ, (f"n={n}, data={data}: {len(differ)} of {cases} (rank, round, tensor) "
                            f"differ, by up to {worst:.3g}; first {differ[:5]}")
        first, last = res[0][data, "gasloc"]["rounds"][0], res[0][data, "gasloc"]["rounds"][-1]
        assert not all(torch.equal(a, b) for a, b in zip(first, last))   # it does train
    # bytes per round: DiLoCo's ring all-reduce (kind outer); GASLoC the same, as kind gossip
    for rank in range(n):
        for data in ("same", "own"):
            diloco, gasloc = res[rank][data, "diloco"], res[rank][data, "gasloc"]
            for d_st, g_st in zip(diloco["stats"], gasloc["stats"]):
                assert _sent_kinds(d_st) == {"outer"} and _sent_kinds(g_st) == {"gossip"}
                assert d_st["comm/outer_sent_bytes"] == ring_all_reduce_bytes(nbytes, n)
                assert g_st["comm/gossip_sent_bytes"] == ring_all_reduce_bytes(nbytes, n)
                assert g_st["comm/gossip_recv_bytes"] == ring_all_reduce_bytes(nbytes, n)
        ablation = res[rank]["ablation_stats"]                # point-to-point with n - 1 peers
        assert _sent_kinds(ablation) == {"gossip"}
        assert ablation["comm/gossip_sent_bytes"] == (n - 1) * nbytes
    for rank in range(n):   # resumed after step 7 == straight through 12 steps (= 4 rounds)
        for name in ("diloco", "gasloc"):
            run = res[rank]["own", name]
            assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["rounds"][-1]))
    own = [res[r]["own", "diloco"]["rounds"][0][0] for r in range(n)]
    same = [res[r]["same", "diloco"]["rounds"][0][0] for r in range(n)]
    assert not torch.equal(own[0], same[0])       # the per-rank data did change the average


def _hetero_resume_worker(rank, world, on_cpu):
    # fixed H_i with an idle worker (H_i = 0), 2peer; progress must agree at round ends
    cfg = StrategyConfig(name="gasloc", topology="2peer", inner_steps=3,
                         inner_steps_per_worker=[3, 0, 2, 3], outer_state_on_cpu=on_cpu)
    strategy, model = _make(cfg)
    h = [3, 0, 2, 3][rank]
    steps_per_round = max(h, 1)
    rounds = 4
    log = _steps(strategy, model, 1, steps_per_round * rounds, rank)
    agreed = [m["progress"] for m in log if m["progress"] is not None]
    idle_drifts = [m["outer/drift_norm"] for m in log if "outer/drift_norm" in m]

    # exact resume: 7 steps, state into fresh objects (other init), 5 more == 12 straight
    def fresh(seed):
        return _make(StrategyConfig(name="gasloc", topology="2peer", inner_steps=3,
                                    outer_state_on_cpu=on_cpu), seed)

    straight, m1 = fresh(0)
    _steps(straight, m1, 1, 12, rank)
    first, m2 = fresh(0)
    _steps(first, m2, 1, 7, rank)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    _steps(first, m2, 8, 9, rank)           # keeps running: the saved state must not change
    second, m3 = fresh(123)
    buf.seek(0)
    second.load_state_dict(torch.load(buf, weights_only=True))
    _steps(second, m3, 8, 12, rank)
    return {"agreed": agreed, "idle_drifts": idle_drifts,
            "resume_equal": torch.equal(flat_params(m1), flat_params(m3)),
            "progress_after": (straight.progress(12), second.progress(12))}


def test_heterogeneous_inner_steps_and_exact_resume():
    # outer state in host memory: on this CPU-only machine it exercises the same code path
    res = run_distributed(_hetero_resume_worker, 4, (True,))
    for rank, r in enumerate(res):
        assert r["agreed"] == [3, 6, 9, 12]                  # same nominal steps on every rank
        assert (all(d == 0.0 for d in r["idle_drifts"])) == (rank == 1)
        assert r["resume_equal"]
        assert r["progress_after"] == (12, 12)


def _run_end_worker(rank, world, strategy_name, per_worker):
    # H = 3 does not divide the run's 7 steps: the last round is 1 step, on every worker
    cfg = StrategyConfig(name=strategy_name, topology="complete", inner_steps=3,
                         inner_steps_per_worker=per_worker)
    model = tiny_model(0)
    strategy = build_local_strategy(cfg, OPT, model, Comm(), total_steps=7)
    log = []
    while not log or (log[-1]["progress"] or 0) < 7:     # the trainer's loop: to the agreed end
        log += _steps(strategy, model, len(log) + 1, len(log) + 1, rank)
    # the run extended to 11 steps (resumed with a larger trainer.max_steps): rounds of H again,
    # from the step it reached, the last one shorter
    longer = build_local_strategy(cfg, OPT, model, Comm(), total_steps=11)
    longer.load_state_dict(strategy.state_dict())
    while (log[-1]["progress"] or 0) < 11:
        log += _steps(longer, model, len(log) + 1, len(log) + 1, rank)
    ends = [m for m in log if m["progress"] is not None]
    return {"inner": [m["outer/inner_steps"] for m in ends],
            "agreed": [m["progress"] for m in ends], "round_ends": [m["step"] for m in ends]}


@pytest.mark.parametrize("strategy_name,per_worker", [("diloco", []), ("gasloc", [3, 2])])
def test_the_last_round_ends_at_the_runs_last_step(strategy_name, per_worker):
    res = run_distributed(_run_end_worker, 2, (strategy_name, per_worker))
    assert res[0]["agreed"] == res[1]["agreed"] == [3, 6, 7, 10, 11]
    assert res[0]["inner"] == [3, 3, 1, 3, 1] and res[0]["round_ends"] == [3, 6, 7, 10, 11]
    if per_worker:      # H_1 = 2 < H: its rounds are shorter, its last ones are the same 1 step
        assert res[1]["inner"] == [2, 2, 1, 2, 1] and res[1]["round_ends"] == [2, 4, 5, 7, 8]


def _budget_worker(rank, world):
    cfg = StrategyConfig(name="gasloc", topology="2peer", inner_steps=5, round_budget_s=0.25)
    strategy, model = _make(cfg)
    log = []
    step = 0
    while strategy.rounds_done < 3:
        step += 1
        log += _steps(strategy, model, step, step, rank, slow_s=0.005 if rank == 0 else 0.04)
    return {"inner": [m["outer/inner_steps"] for m in log if "outer/inner_steps" in m],
            "agreed": [m["progress"] for m in log if m["progress"] is not None]}


def test_round_budget_gives_a_slow_worker_fewer_inner_steps():
    fast, slow = run_distributed(_budget_worker, 2)
    assert fast["agreed"] == slow["agreed"] == [5, 10, 15]
    assert sum(slow["inner"]) < sum(fast["inner"]) and min(slow["inner"]) >= 1


def test_bad_config_is_refused_with_a_clear_message():
    ok = StrategyConfig(name="gasloc", topology="2peer")
    validate(ok, OPT, 4)
    bad = [
        (dict(name="localsgd"), "unknown local strategy"),
        (dict(topology="torus"), "unknown topology"),
        (dict(name="diloco", topology="2peer"), "topology must be complete"),
        (dict(inner_steps=-1), "inner_steps"),
        (dict(inner_steps_per_worker=[3, 3]), "world size is 4"),
        (dict(inner_steps_per_worker=[3, 3, -1, 3]), ">= 0"),
        (dict(outer_lr=0.0), "outer_lr"),
        (dict(outer_momentum=1.0), "outer_momentum"),
        (dict(round_budget_s=-1.0), "round_budget_s"),
        (dict(round_budget_s=1.0, inner_steps_per_worker=[1, 1, 1, 1]), "not both"),
        (dict(topology="complete", overlap_steps=30), r"overlap_steps \(tau\) must be in"),
        (dict(topology="complete", overlap_steps=-1), r"overlap_steps \(tau\) must be in"),
        (dict(topology="complete", overlap_local_weight=1.5), "overlap_local_weight"),
        (dict(topology="complete", overlap_merge="average"), "overlap_merge must be"),
        (dict(topology="complete", overlap_merge="carry", overlap_local_weight=0.5),
         "set strategy.overlap_merge=mix"),
        (dict(topology="complete", overlap_steps=1,
              elastic=ElasticConfig(enabled=True, replica=0, slots=1)), "commits by a vote"),
    ]
    for fields, msg in bad:
        with pytest.raises(ValueError, match=msg):
            validate(StrategyConfig(**{"name": "gasloc", "topology": "2peer", **fields}), OPT, 4)
    with pytest.raises(ValueError, match="must not communicate"):
        validate(ok, OptimizerConfig(name="scape"), 4)


# -- overlapped rounds (overlap_steps tau > 0) ------------------------------------------------------
OPT_NOCLIP = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, clip_grad=0.0)
OVERLAP_H, OVERLAP_STEPS = 4, 14     # rounds end at steps 4, 8, 12 and (the last, blocking) 14


def _overlap_reference(rank, world, tau: float, merge: str, alpha: float, topology="complete",
                       mix_momentum=True, eta=0.7, gamma=0.9):
    """This rank's flat parameters after every step, from the rule in float64. At a round's end
    the outer point x is computed: the complete graph, from the drift averaged over the
    workers (y = theta0 - eta * avg(theta0 - theta), x = y + gamma (y - y_prev)); a gossip
    topology, as the mix sum_j W_t[i, j] x_j of every worker's own x (the ablation
    ``mix_momentum=False`` mixes y and adds gamma (y - y_prev) after). It lands tau inner steps
    into the next round (theta0 <- x; carry: theta <- theta + x - theta_end, theta_end this
    worker's parameters at the round's end; mix: theta <- alpha theta + (1 - alpha) x); the
    run's last round blocks (theta <- x)."""
    from scape_train.optim.dense import build_local_optimizer

    model = tiny_model(0)
    opt, _ = build_local_optimizer(OPT_NOCLIP, model, adams=False)
    params = [p for g in opt.param_groups for p in g["params"]]
    anchor = [p.detach().double().clone() for p in params]
    y_prev = [a.clone() for a in anchor]
    pending, k, nominal, rounds, out = None, 0, 0, 0, []

    def flat(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    def split(v):
        parts, offset = [], 0
        for p in params:
            parts.append(v[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return parts

    def everyone(v):
        gathered = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(gathered, v)
        return gathered

    def outer_point(t):
        """x of this round (y_prev moves to this round's y)."""
        if topology == "complete":
            avg = split(torch.stack(everyone(flat([a - p.double() for a, p in zip(anchor, params)])))
                        .mean(0))
            ys = [anchor[i] - eta * avg[i] for i in range(len(params))]
        else:
            ys = [a + eta * (p.double() - a) for a, p in zip(anchor, params)]
        moment = [gamma * (y - yp) for y, yp in zip(ys, y_prev)]
        y_prev[:] = ys
        if topology == "complete":
            return [y + m for y, m in zip(ys, moment)]
        w = mixing_matrix(topology, world, t, 0)
        own = flat([y + m for y, m in zip(ys, moment)] if mix_momentum else ys)
        mixed = sum(w[rank, j] * v for j, v in enumerate(everyone(own)))
        return [x if mix_momentum else x + m for x, m in zip(split(mixed), moment)]

    def land(x, weight, end=None):
        for i, p in enumerate(params):
            anchor[i] = x[i]
            with torch.no_grad():
                if end is None:
                    p.copy_(weight * p.double() + (1 - weight) * x[i])
                else:
                    p.copy_(p.double() + x[i] - end[i])

    for step in range(1, OVERLAP_STEPS + 1):
        x, y = batch(step, rank)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        k += 1
        if pending is not None and k >= tau:
            land(*pending)
            pending = None
        left = OVERLAP_STEPS - nominal
        if k == OVERLAP_H or 0 < left <= k:
            if pending is not None:   # a round no longer than tau: the last exchange lands first
                land(*pending)
                pending = None
            x_new = outer_point(rounds)
            if left <= OVERLAP_H:
                land(x_new, 0.0)
            else:
                end = [p.detach().double().clone() for p in params] if merge == "carry" else None
                pending = (x_new, alpha, end)
            nominal += min(OVERLAP_H, left)
            rounds += 1
            k = 0
        out.append(flat_params(model))
    return out


def _overlap_worker(rank, world, tau, merge, alpha, cut_at, topology="complete", mix_momentum=True):
    """The overlapped strategy step by step against the reference, and resumed from its state
    taken at step ``cut_at``: DiLoCo (checked equal to complete-graph GASLoC), or GASLoC on a
    gossip ``topology``."""
    name = "diloco" if topology == "complete" else "gasloc"

    def make(name, model):
        cfg = StrategyConfig(name=name, topology=topology, inner_steps=OVERLAP_H,
                             overlap_steps=tau, overlap_merge=merge, overlap_local_weight=alpha,
                             mix_momentum=mix_momentum)
        return build_local_strategy(cfg, OPT_NOCLIP, model, Comm(), total_steps=OVERLAP_STEPS)

    runs = {}
    for run in ((name, "gasloc") if topology == "complete" else (name,)):
        model = tiny_model(0)
        strategy = make(run, model)
        log = _steps(strategy, model, 1, OVERLAP_STEPS, rank)
        runs[run] = (flat_params(model), log)
    reference = _overlap_reference(rank, world, tau, merge, alpha, topology, mix_momentum)
    model = tiny_model(0)
    strategy = make(name, model)
    history = []
    for step in range(1, OVERLAP_STEPS + 1):
        _steps(strategy, model, step, step, rank)
        history.append(flat_params(model))
        if step == cut_at:   # the state into a fresh strategy and model, as a resume does
            buf = io.BytesIO()
            torch.save(strategy.state_dict(), buf)
            buf.seek(0)
            model = tiny_model(1)
            strategy = make(name, model)
            strategy.load_state_dict(torch.load(buf, weights_only=False))
    ends = [m for m in runs[name][1] if m["progress"] is not None]
    return {"history": history, "reference": reference, "final": runs[name][0],
            "gasloc_final": runs.get("gasloc", runs[name])[0],
            "agreed": [m["progress"] for m in ends]}


def _check_overlap(res, tau):
    for rank, r in enumerate(res):
        assert r["agreed"] == [4, 8, 12, 14]
        for step, (got, want) in enumerate(zip(r["history"], r["reference"]), start=1):
            torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} step {step}: {m}")
        # resumed (with the exchange in flight at a round's end, or mid-overlap) == uninterrupted
        assert torch.equal(r["history"][-1], r["final"])
        assert torch.equal(r["gasloc_final"], r["final"])   # the complete graph is DiLoCo


@pytest.mark.parametrize("tau,merge,alpha,cut_at", [
    (2, "carry", 0.0, 4), (3, "carry", 0.0, 5), (2, "mix", 0.5, 4), (1, "mix", 0.0, 9),
    (3, "mix", 1.0, 5)])
def test_overlapped_rounds_land_tau_steps_later_and_resume_exactly(tau, merge, alpha, cut_at):
    res = run_distributed(_overlap_worker, 2, (tau, merge, alpha, cut_at))
    _check_overlap(res, tau)
    assert torch.equal(res[0]["final"], res[1]["final"])     # the last round blocks


@pytest.mark.parametrize("topology,mix_momentum,tau,merge,alpha,cut_at", [
    ("2peer", True, 2, "mix", 0.0, 4), ("2peer", True, 3, "carry", 0.0, 9),
    ("1peer", True, 2, "mix", 0.5, 5), ("2peer", False, 1, "carry", 0.0, 8)])
def test_overlapped_gossip_rounds_land_tau_steps_later_and_resume_exactly(
        topology, mix_momentum, tau, merge, alpha, cut_at):
    """GASLoC's gossip exchange in flight behind tau inner steps: every step against the rule
    on 4 workers (whose replicas differ), and resumed from the strategy's state."""
    res = run_distributed(_overlap_worker, 4, (tau, merge, alpha, cut_at, topology, mix_momentum))
    _check_overlap(res, tau)
    assert not torch.equal(res[0]["final"], res[1]["final"])   # gossip: the replicas differ


# -- the trainer end to end ---------------------------------------------------------------------


def _trainer_job(rank, world, run_dir, tok_cache, *overrides):
    """The small job with ``overrides`` on this rank: (step, val loss, last checkpoint)."""
    from scape_train.train import run
    from tests.helpers import SMALL, compose_config

    cfg = compose_config(SMALL + [f"run_dir={run_dir}", f"data.tokenizer.cache_dir={tok_cache}",
                                  *overrides])
    summary = run(cfg)
    return summary["step"], summary.get("val_loss"), summary.get("checkpoint")


GASLOC_2PEER_H2 = ("strategy=gasloc", "strategy.topology=2peer", "strategy.inner_steps=2")
SPARSELOCO = ("strategy=sparseloco", "strategy.sparse_chunk=512", "strategy.sparse_topk=8")
STREAMING = ("strategy=diloco", "strategy.fragments=2")     # with H = 2: a fragment every step


@pytest.mark.slow
def test_trainer_runs_gasloc_on_two_ranks(tmp_path):
    res = run_distributed(_trainer_job, 2, (str(tmp_path), str(tmp_path / "tok"), *GASLOC_2PEER_H2,
                                            "trainer.max_steps=7", "trainer.checkpoint_every=4"))
    assert res[0] == res[1]
    step, val, ckpt = res[0]
    # H = 2 does not divide 7 steps: the last round is one step, and the run ends at step 7
    assert step == 7 and val == val and ckpt.endswith("step_00000007")
    rows = (tmp_path / "metrics.jsonl").read_text()
    assert "outer/round" in rows and "comm/gossip_sent_bytes" in rows


@pytest.mark.slow
def test_trainer_with_per_worker_inner_steps_checkpoints_and_resumes(tmp_path):
    job = (str(tmp_path), str(tmp_path / "tok"), *GASLOC_2PEER_H2,
           "strategy.inner_steps_per_worker=[2,1]", "trainer.max_steps=8")
    first = run_distributed(_trainer_job, 2, (*job, "trainer.stop_after=4"))
    assert first[0][2] == first[1][2] and first[0][2].endswith("step_00000004")
    second = run_distributed(_trainer_job, 2, (*job, "resume=auto"))
    # the local steps differ (H_i = 2 and 1); the validation and the checkpoint are agreed
    assert second[0][1:] == second[1][1:] and second[0][2].endswith("step_00000008")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [("strategy=diloco",), GASLOC_2PEER_H2[:2], SPARSELOCO,
                                      STREAMING],
                         ids=["diloco", "gasloc_2peer", "sparseloco", "streaming_diloco"])
def test_a_resumed_runs_total_bytes_equal_the_uninterrupted_runs(tmp_path, strategy):
    """A resumed local-step run logs what the uninterrupted one logs (its total bytes included:
    the start-up broadcast of the parameters is sent once per run; a resume, whose checkpoint
    sets them, skips it). GASLoC's replicas differ: each rank's own comes back."""
    tok = str(tmp_path / "tok")
    job = (*strategy, "strategy.inner_steps=2", "trainer.max_steps=6")
    whole = run_distributed(_trainer_job, 2, (str(tmp_path / "whole"), tok, *job))
    run_distributed(_trainer_job, 2, (str(tmp_path / "cut"), tok, *job, "trainer.stop_after=4"))
    again = run_distributed(_trainer_job, 2, (str(tmp_path / "cut"), tok, *job, "resume=auto"))
    assert [r[1] for r in again] == [r[1] for r in whole]
    assert total_sent_bytes(tmp_path / "cut") == total_sent_bytes(tmp_path / "whole") > 0
    assert_same_record(tmp_path / "whole", tmp_path / "cut")   # every column but the clock's


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [("strategy=diloco",), GASLOC_2PEER_H2[:2], SPARSELOCO],
                         ids=["diloco", "gasloc_2peer", "sparseloco"])
def test_trainer_overlapped_rounds_resume_exactly_and_send_the_blocking_runs_bytes(tmp_path,
                                                                                    strategy):
    """Stopped at step 3 (a round's exchange in flight: DiLoCo's all-reduce, or GASLoC's gossip
    exchange) and resumed, an overlapped run logs what the uninterrupted one logs; the overlap
    moves no byte: a blocking run of the same rounds sends as much."""
    tok = str(tmp_path / "tok")
    diloco = (*strategy, "strategy.inner_steps=3", "trainer.max_steps=9")
    overlap = (*diloco, "strategy.overlap_steps=1", "strategy.overlap_merge=carry")
    whole = run_distributed(_trainer_job, 2, (str(tmp_path / "whole"), tok, *overlap))
    run_distributed(_trainer_job, 2, (str(tmp_path / "cut"), tok, *overlap, "trainer.stop_after=3"))
    again = run_distributed(_trainer_job, 2, (str(tmp_path / "cut"), tok, *overlap, "resume=auto"))
    blocking = run_distributed(_trainer_job, 2, (str(tmp_path / "blocking"), tok, *diloco))
    assert [r[1] for r in again] == [r[1] for r in whole]
    assert_same_record(tmp_path / "whole", tmp_path / "cut")
    assert total_sent_bytes(tmp_path / "whole") == total_sent_bytes(tmp_path / "blocking") > 0
    assert whole[0][1] != blocking[0][1]     # the overlap changed the trajectory
    from tests._fault_job import final_params

    a, b = final_params(tmp_path / "whole"), final_params(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)


EXPERIMENTS = ["tiny_diloco", "tiny_streaming_diloco", "tiny_gasloc_2peer", "tiny_sparseloco", "gasloc_134m_h30", "gasloc_1peer_134m_h30",
               "diloco_134m_h30", "gasloc_134m_h1", "dadam_134m_h1", "gasloc_551m_h1",
               "gasloc_551m_h30", "diloco_551m_h30", "gasloc_134m_h30_straggler"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_configs_compose_and_validate(name):
    from tests.helpers import SMALL, compose_config

    cfg = compose_config([f"+experiment={name}"])
    validate(cfg.strategy, cfg.optimizer, 16)
    assert cfg.strategy.name in ("diloco", "gasloc", "sparseloco") and cfg.run_name == name
    assert cfg.model.name in ("llama_tiny", "llama_134m", "llama_551m")
