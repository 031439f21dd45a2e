"""NCCL's rules, enforced on the CPU: what would stop or serialize a GPU run fails here first.

- every collective of the package goes through ``comm.py`` (the guard the suite runs under)
  and ``Comm`` refuses a tensor that is not on its group's device (NCCL refuses host tensors);
- the step timer never synchronizes the device inside a step (that would wait for SCAPE's
  overlapped mask all-gather and stop the host from running ahead);
- SCAPE's step and the dense step read nothing back from the device and copy nothing to it
  blocking: their host-sync count, as counted at the dispatcher (``scape_train.profiling``: reads,
  data-dependent sizes, blocking host->device copies, tensors built from host data), is zero
  through a density warm-up, and so is the trainer's whole step (the loss / non-finite / stop
  agreement is read a step late; one read with ``nan_policy=skip``, which must decide at once).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import scape_train.checkpoint as checkpoint_module
from scape_train import metrics as metrics_module
from scape_train.comm import Comm, CollectiveOutsideCommError
from scape_train.optim.config import OptimizerConfig
from scape_train.profiling import DeviceOpCounter

from ._dist import run_distributed
from ._optim_common import batch, loss_fn, make


def _guard_worker(rank, world):
    t = torch.ones(3)
    # package code calling torch.distributed directly, as checkpoint.py and distributed.py did
    snippet = compile("dist.all_reduce(t)", checkpoint_module.__file__, "exec")
    with pytest.raises(CollectiveOutsideCommError, match="outside comm.py"):
        exec(snippet, {"dist": dist, "t": t})
    Comm().all_reduce(t, kind="x", average=False)       # through Comm: allowed
    with pytest.raises(ValueError, match="NCCL refuses host tensors"):
        Comm(device=torch.device("meta")).all_reduce(torch.ones(2), kind="x")
    return t.tolist()


def test_collectives_only_through_comm_on_its_device():
    assert run_distributed(_guard_worker, 2) == [[2.0, 2.0, 2.0]] * 2


class _FakeEvent:
    created = 0

    def __init__(self, enable_timing=False):
        _FakeEvent.created += 1
        self.t = None

    def record(self, stream=None):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_step_timer_never_synchronizes_inside_a_step(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    timer = metrics_module.StepTimer(torch.device("cuda", 0))
    for _ in range(5):
        for name in ("data", "fwd_bwd", "optimizer"):
            with timer.phase(name):
                pass
    assert syncs == [], "a device-wide synchronize inside the step's phases"
    assert _FakeEvent.created == 30
    totals = timer.pop()               # events are read here, once per log window
    assert set(totals) == {"data", "fwd_bwd", "optimizer"} and all(v >= 0 for v in totals.values())


def _step_sync_worker(rank, world, cfg_kw, steps):
    strategy, wrapped, _ = make(OptimizerConfig(**cfg_kw), width=64)
    counts = []
    for t in range(1, steps + 1):
        x, y = batch(t, rank)
        loss_fn(wrapped, x, y).backward()
        with DeviceOpCounter() as ops:
            strategy.step(1e-3)
        strategy.zero_grad()
        counts.append(dict(ops.sync_sites))
    strategy.close()
    return counts


SCAPE = dict(name="scape", density=0.1, density_warmup_steps=3, clip_grad=0.5)


@pytest.mark.parametrize("cfg_kw", [
    SCAPE,
    {**SCAPE, "sharded": True, "partitioner": "flat"},
    pytest.param({**SCAPE, "sharded": True, "partitioner": "tensor"}, marks=pytest.mark.slow),
    pytest.param({**SCAPE, "payload_dtype": "fp8_e4m3", "mask_coding": "elias_fano"},
                 marks=pytest.mark.slow),
    pytest.param({**SCAPE, "sharded": True, "partitioner": "flat", "payload_dtype": "bf16",
                  "mask_coding": "indices"}, marks=pytest.mark.slow),
    {**SCAPE, "offload_residuals": True, "payload_dtype": "bf16"},
    pytest.param({**SCAPE, "sharded": True, "partitioner": "tensor", "offload_residuals": True,
                  "payload_dtype": "fp8_e4m3"}, marks=pytest.mark.slow),
    pytest.param(dict(name="adams", clip_grad=0.5), marks=pytest.mark.slow),
    pytest.param(dict(name="adamw", clip_grad=0.5), marks=pytest.mark.slow),
], ids=["scape-replicated", "scape-sharded-flat", "scape-sharded-tensor", "scape-fp8-ef",
        "scape-sharded-bf16-indices", "scape-offload-bf16", "scape-sharded-offload-fp8",
        "adams", "adamw"])
def test_optimizer_step_reads_nothing_back_from_the_device(cfg_kw):
    """Budget: 0 host syncs per step, through a density warm-up (steps 1-3: a new density, a
    new mask plan, new tables every step) and after it."""
    for rank_counts in run_distributed(_step_sync_worker, 3, (cfg_kw, 5)):
        assert rank_counts == [{}] * 5, rank_counts


def test_the_counter_sees_host_data_and_blocking_copies_to_a_device():
    """What a CPU run cannot show by itself: a tensor made from host data inside a step (on a
    GPU, a blocking copy follows), a blocking copy to another device (``meta`` stands in for
    CUDA), and tables built through ``host_to_device``, counted apart."""
    from scape_train.host_to_device import host_table, upload

    with DeviceOpCounter() as ops:
        torch.tensor([1.0, 2.0])
        torch.ones(3).to("meta")
        torch.ones(3).to("meta", non_blocking=True)    # pageable memory: still staged
        torch.empty(2, device="meta").copy_(torch.ones(2))
        host_table([1, 2, 3])
        upload([4, 5], torch.device("cpu"))
        torch.full((1,), 0.5)                          # a fill on the device: no copy
    assert dict(ops.sync_sites) == {"host_data": 1, "h2d_copy": 3}, ops.sync_sites
    assert ops.host_tables == 2


@pytest.mark.parametrize("extra,syncs", [
    (["optimizer=scape", "optimizer.density=0.1", "optimizer.density_warmup_steps=2"], {}),
    (["optimizer=adamw"], {}),
    (["optimizer=adamw", "trainer.nan_policy=skip"], {"tolist": 1})],
    ids=["scape", "adamw", "adamw_skip"])
def test_trainer_step_reads_nothing_back(tmp_path, tmp_path_factory, extra, syncs, monkeypatch):
    """The loss / non-finite / stop agreement is read one step late, from host memory (a skip
    policy reads it at once: the step's one host sync); metrics are read at log steps only."""
    from scape_train.metrics import StepTimer
    from scape_train.preemption import StopSignal
    from scape_train.train import Trainer

    from . import _fault_job as fj
    from .helpers import SMALL, compose_config

    cfg = compose_config(SMALL + [f"run_dir={tmp_path}",
                                  f"data.tokenizer.cache_dir={fj.tok_cache(tmp_path_factory)}",
                                  "trainer.max_steps=6", *extra])
    trainer = Trainer(cfg)
    timer, stop = StepTimer(trainer.info.device), StopSignal()
    try:
        per_step, host_reads = [], []
        for _ in range(4):
            with DeviceOpCounter(trace=True) as ops:
                trainer.train_step(timer, stop)
            per_step.append(dict(ops.sync_sites))
            host_reads.append(ops.host_tables)
            where = dict(ops.sync_lines)
    finally:
        trainer.train_loader.close()
        trainer.strategy.close()
    assert per_step[1:] == [syncs] * 3, (per_step, where)
    if not syncs:      # the previous step's flags, taken from host memory
        assert trainer.flags.pending == 4 and all(n >= 1 for n in host_reads[1:]), host_reads
