"""Dense DDP strategies (AdamW, AdamS), top-k AdamW and PowerSGD on real gloo groups."""

from __future__ import annotations

import pytest
import torch

from scape_train.metrics import read_on_host

from scape_train.comm import ring_all_gather_bytes, ring_all_reduce_bytes
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.density import segment_k
from scape_train.optim.powersgd import powersgd_sizes

from ._dist import run_distributed
from ._optim_common import batch, flat_params, loss_fn, make, tiny_model

pytestmark = pytest.mark.dist
WORLD = 2
MICRO = 2


def _ddp_worker(rank, world, name):
    from ._optim_common import train_step
    strategy, wrapped, _ = make(OptimizerConfig(name=name, lr=1e-2, clip_grad=0.5))
    out = []
    for t in range(1, 4):
        strategy.comm.pop_stats()
        metrics = train_step(strategy, wrapped, t, rank, micro=MICRO)
        out.append((flat_params(wrapped), metrics["grad_norm"],
                    strategy.comm.pop_stats()["comm/grad_sent_bytes"]))
    return out


def single_process_reference(name):
    """The same steps in one process on the concatenation of every rank's batch."""
    strategy, model, _ = make(OptimizerConfig(name=name, lr=1e-2, clip_grad=0.5))
    out = []
    for t in range(1, 4):
        xs, ys = zip(*[batch(t, r, 8 * MICRO) for r in range(WORLD)])
        loss_fn(model, torch.cat(xs), torch.cat(ys)).backward()
        metrics = read_on_host(strategy.step(1e-2))
        strategy.zero_grad()
        out.append((flat_params(model), metrics["grad_norm"]))
    return out


@pytest.mark.parametrize("name", ["adamw", pytest.param("adams", marks=pytest.mark.slow)])
def test_ddp_equals_single_process_on_concatenated_batch(name):
    results = run_distributed(_ddp_worker, WORLD, (name,))
    ref = single_process_reference(name)
    numel = sum(p.numel() for p in tiny_model().parameters())
    for rank_steps in results:
        for (p, norm, sent), (p_ref, norm_ref) in zip(rank_steps, ref):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)
            assert norm == pytest.approx(norm_ref, rel=1e-5)
            # one counted all-reduce of every gradient per step, despite two micro-batches
            assert sent == ring_all_reduce_bytes(numel * 4, WORLD)
    assert ref[0][1] > 0.5   # the clip acted


def _grad_storages_worker(rank, world, flat_grads):
    """Gradient storages after two steps (zero_grad sets p.grad to None between them) and a
    third accumulated backward, and their bytes."""
    from ._optim_common import train_step
    strategy, wrapped, model = make(OptimizerConfig(name="adamw", flat_grads=flat_grads))
    for t in (1, 2):
        train_step(strategy, wrapped, t, rank, micro=MICRO)
    x, y = batch(3, rank, 8 * MICRO)
    for i, (xs, ys) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
        with strategy.sync_context(wrapped, i == MICRO - 1):
            loss_fn(wrapped, xs, ys).backward()
    grads = [p.grad for p in model.parameters()]
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    return len(grads), len(storages), sum(storages.values())


def test_ddp_gradients_are_views_of_its_buckets():
    """No second gradient copy: with optimizer.flat_grads (the default) every p.grad is a view
    of one of DDP's buckets; off, autograd's own tensors (one storage each)."""
    n_params, n_storages, nbytes = run_distributed(_grad_storages_worker, WORLD, (True,))[0]
    numel = sum(p.numel() for p in tiny_model().parameters())
    assert n_storages < n_params and nbytes == 4 * numel, (n_params, n_storages, nbytes)
    n_params, n_storages, _ = run_distributed(_grad_storages_worker, WORLD, (False,))[0]
    assert n_storages == n_params
    # the memory plan: the buckets are the gradient row, held throughout, no second copy
    from scape_train.plan.optimizer_memory import optimizer_memory
    from tests.helpers import compose_config

    plan = optimizer_memory(compose_config(["optimizer=adamw"]), tiny_model(), WORLD, on_gpu=False)
    assert plan.grads_persistent and sum(b for _, b in plan.state) == 2 * 4 * numel, plan.state


def _topk_worker(rank, world):
    return {d: _topk_run(rank, d) for d in (1.0, 0.3)}


def _topk_run(rank, density):
    from ._optim_common import train_step
    kw = dict(lr=1e-2, clip_grad=0.0, density=density, density_schedule="constant")
    topk, w_topk, model = make(OptimizerConfig(name="topk_adamw", **kw))
    dense, w_dense, _ = make(OptimizerConfig(name="adamw", **kw))
    out = []
    for t in range(1, 4):
        topk.comm.pop_stats()
        m = train_step(topk, w_topk, t, rank)
        sent = topk.comm.pop_stats()["comm/payload_sent_bytes"]
        train_step(dense, w_dense, t, rank)
        out.append((flat_params(w_topk), flat_params(w_dense), sent, m["topk/payload_numel"]))
    shapes = [(p.numel(), p.ndim) for p in model.parameters()]
    return out, shapes


def test_topk_adamw_density_one_is_dense_and_sparse_counts_bytes():
    both = run_distributed(_topk_worker, WORLD)
    dense_case, _ = both[0][1.0]
    for p_topk, p_dense, _, _ in dense_case:
        torch.testing.assert_close(p_topk, p_dense, rtol=1e-5, atol=1e-6)
    res = [r[0.3] for r in both]
    steps, shapes = res[0]
    k = sum(n if nd < 2 else segment_k(n, 0.3) for n, nd in shapes)
    for (p_topk, p_dense, sent, payload), (p1, *_rest) in zip(steps, res[1][0]):
        assert payload == k
        assert sent == ring_all_gather_bytes(2 * k * 4, WORLD)   # values + int32 indices
        assert torch.equal(p_topk, p1)                           # ranks agree
        assert torch.isfinite(p_topk).all() and not torch.equal(p_topk, p_dense)


def _powersgd_worker(rank, world):
    from ._optim_common import train_step
    strategy, wrapped, _ = make(OptimizerConfig(name="powersgd", lr=1e-2, powersgd_rank=2,
                                                powersgd_start_iter=2))
    out = []
    for t in range(1, 5):
        strategy.comm.pop_stats()
        train_step(strategy, wrapped, t, rank)
        ps = strategy.ps_state
        out.append(dict(sent=strategy.comm.pop_stats()["comm/grad_sent_bytes"],
                        p=sum(v.numel() for v in ps.p_memory_dict.values()),
                        q=sum(v.numel() for v in ps.q_memory_dict.values()),
                        params=flat_params(wrapped)))
    return out


def test_powersgd_runs_and_counts_bytes():
    results = run_distributed(_powersgd_worker, WORLD)
    model = tiny_model()
    numel = sum(p.numel() for p in model.parameters())
    unc, p, q = powersgd_sizes([p.shape for p in model.parameters()], 2, 2.0)
    assert unc + p + q < numel and p > 0
    steps = results[0]
    assert steps[0]["sent"] == ring_all_reduce_bytes(numel * 4, WORLD)    # vanilla warm-up
    for s in steps[2:]:
        assert (s["p"], s["q"]) == (p, q)        # the hook's real buffers have the counted sizes
        # one bucket here: three counted all-reduces (uncompressed, P, Q)
        assert s["sent"] == sum(ring_all_reduce_bytes(n * 4, WORLD) for n in (unc, p, q))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a["params"], b["params"])
        assert torch.isfinite(a["params"]).all()
