"""The analytic SCAPE byte accounting equals the bytes real multi-rank steps count (Comm)."""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.scape.accounting import (StepBytes, dense_allreduce_bytes,
                                                scape_step_bytes)
from scape_train.optim.scape.partition import ParamLayout

from ._dist import run_distributed
from ._optim_common import make, sent_bytes_per_kind, tiny_model, train_step

# (sharded, partitioner, density): both engines, both partitioners, several k per segment.
CASES = [(False, "tensor", 0.1), (False, "flat", 0.3), (True, "flat", 0.1), (True, "tensor", 0.05)]
WIDTH = 40
STEPS = 2


def _counted(rank: int, world: int) -> list[dict]:
    out = []
    for sharded, partitioner, density in CASES:
        cfg = OptimizerConfig(name="scape", density=density, density_warmup_steps=0,
                              sharded=sharded, partitioner=partitioner, use_triton="off")
        strategy, wrapped, _ = make(cfg, width=WIDTH)
        per_step = sent_bytes_per_kind(strategy, wrapped, range(1, STEPS + 1), rank)
        strategy.close()
        out.append({"steps": per_step})
    dense_cfg = OptimizerConfig(name="adams")
    strategy, wrapped, _ = make(dense_cfg, width=WIDTH)
    strategy.comm.pop_stats()
    train_step(strategy, wrapped, 1, rank)
    out.append({"grad": int(strategy.comm.pop_stats().get("comm/grad_sent_bytes", -1))})
    return out


@pytest.mark.slow
def test_analytic_bytes_equal_counted_bytes_of_real_steps():
    world = 3
    results = run_distributed(_counted, world_size=world)
    layout = ParamLayout(tiny_model(width=WIDTH), weight_decay=0.1, exclude_norm_bias=True)
    for i, (sharded, partitioner, density) in enumerate(CASES):
        want = scape_step_bytes(layout, world, density, partitioner=partitioner,
                                sharded=sharded).as_dict()
        for rank, res in enumerate(results):
            # Step 1 also gathers its first mask synchronously; steps 2.. are the steady state.
            for step, got in enumerate(res[i]["steps"][1:], start=2):
                for kind in ("payload", "mask", "params", "norm"):
                    assert got.get(kind, 0) == want[kind], (
                        f"{CASES[i]} rank {rank} step {step} {kind}: counted {got.get(kind, 0)}, "
                        f"analytic {want[kind]}")
            first = res[i]["steps"][0]
            assert first["mask"] == 2 * want["mask"], "step 1: synchronous M_1 + async M_2"
    # The denominator of every ratio: the dense DDP all-reduce (one bucket here, so exact).
    for res in results:
        assert res[-1]["grad"] == dense_allreduce_bytes(layout, world)


def test_scaling_and_edge_cases():
    layout = ParamLayout(tiny_model(width=WIDTH), weight_decay=0.1, exclude_norm_bias=True)
    assert scape_step_bytes(layout, 1, 0.1) == StepBytes()
    sparse = scape_step_bytes(layout, 4, 0.01)
    dense = scape_step_bytes(layout, 4, 1.0)
    assert sparse.payload < dense.payload
    # at density 1 the payload is the whole gradient: the dense all-reduce
    assert dense.payload == dense_allreduce_bytes(layout, 4)
    with pytest.raises(ValueError, match="density"):
        scape_step_bytes(layout, 4, 0.0)


def test_meta_device_layout_of_a_large_model_needs_no_memory():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.LayerNorm(8192))
    layout = ParamLayout(model, weight_decay=0.1, exclude_norm_bias=True)
    got = scape_step_bytes(layout, 8, 0.01, sharded=True, partitioner="flat")
    assert got.payload > 0 and got.params > 0 and got.mask > 0
    # 99% sparsity: the fp32 payload is ~1% of the dense volume; the mask adds ~1 bit/element
    assert got.total < 0.1 * dense_allreduce_bytes(layout, 8)
