"""The SCAPE step's memory, traced from the real code on fake tensors.

The plan runs the real :class:`ScapeStrategy` -- the rank owning the largest range of a
``world``-rank partition -- under ``FakeTensorMode`` (shapes, no data, no compute) with a
:class:`PlanComm` whose collectives move nothing, and counts live storages with
:class:`LiveBytes`, for either engine: the reference step (``optim/scape/replicated.py``,
``sharded.py``: full-size buffers) and the fused step (``optim/scape/fused.py``: k-sized gathers,
int64 index vectors and mask decode temporaries whose lifetimes follow Python's locals). A hand
replay of either would drift from the code at every edit. Three steps: the first builds M_1
synchronously (and the fused engine's index plans), the second and third are the steady state
the plan reports.

What a trace cannot see, it adds: CPU ``torch.topk`` sorts (value, int64 index) pairs of its
whole input (16 bytes per element of workspace). The traced step runs the torch kernel path
(``use_triton=off``) on a CPU fake device; on a GPU its figure is rounded to the CUDA
allocator's blocks.

Fake tensors also hold the code to its no-host-sync rule: a value read on the host in the step
(``.item()``, ``.tolist()``, a data-dependent shape) fails the trace; the step has one path on
every device, the static-shape one a GPU needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from scape_train.comm import Comm, Handle
from scape_train.plan.tracker import CUDA_BLOCK, LiveBytes

CPU_TOPK_WORKSPACE = 16        # bytes per input element of CPU topk's sort


class PlanComm(Comm):
    """Rank ``rank`` of ``world`` for planning: collectives return at once and move nothing
    (outputs keep their fake contents), so a step traces as it runs on that rank."""

    def __init__(self, rank: int, world: int):
        super().__init__(device=torch.device("cpu"))
        self.rank, self.world, self.enabled = rank, world, False

    def all_reduce(self, tensor, *, kind, average=True, op="sum", async_op=False) -> Handle:
        return Handle(self, kind)

    def all_gather(self, output, shard, *, kind, async_op=False) -> Handle:
        return Handle(self, kind)

    def reduce_scatter(self, output, input, *, kind, average=True, async_op=False) -> Handle:
        return Handle(self, kind)

    def all_to_all(self, output, input, *, kind, async_op=False) -> Handle:
        return Handle(self, kind)

    def broadcast(self, tensor, src=0, *, kind) -> Handle:
        return Handle(self, kind)


class _WithWorkspace(LiveBytes):
    """LiveBytes plus the internal workspace of ops that allocate outside the dispatcher."""

    def __init__(self, round_to: int, cpu_topk: bool):
        super().__init__(round_to)
        self.cpu_topk = cpu_topk
        self.peak_what = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.cpu_topk and func is torch.ops.aten.topk.default:
            spike = CPU_TOPK_WORKSPACE * args[0].numel()
            if self.live + spike > self.peak:
                self.peak, self.peak_op = self.live + spike, self.ops
                self.peak_by_category = dict(self.by_category)
                self.peak_what = "top-k of |c| (CPU sort workspace)"
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.peak_what = f"{self.category}: {func.__name__}"
        return out


@dataclass(frozen=True)
class StepMemory:
    held: int           # bytes the strategy holds between steps (all its state)
    step: int           # extra bytes at the peak of a steady step, beyond ``held``
    where: str
    density: float      # the density traced


def trace_step(cfg, model_cfg, vocab_size: int, world: int, density: float, on_gpu: bool,
               engine: str = "fused") -> StepMemory:
    """The ``engine`` ("fused" or "reference") step of ``cfg`` (an app config) at a constant
    ``density``, traced on the rank owning the largest range of ``world`` (across torchft's
    replica groups, ``strategy.elastic``, a low-precision payload takes its all-gather form)."""
    from scape_train.models.build import resolve_config

    o = dataclasses.replace(cfg.optimizer, density=density, density_warmup_steps=0,
                            density_start_step=0, density_cooldown_steps=0,
                            scape_impl=engine, use_triton="off")
    return _trace(o, resolve_config(model_cfg, vocab_size), world, density, on_gpu,
                  all_to_all=not cfg.strategy.elastic.enabled)


def _trace(o, resolved, world: int, density: float, on_gpu: bool,
           all_to_all: bool = True) -> StepMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scape_train.models.build import ARCHS
    from scape_train.optim.scape.partition import ParamLayout, build_partition
    from scape_train.optim.scape.strategy import ScapeStrategy

    tracker = _WithWorkspace(CUDA_BLOCK if on_gpu else 1, cpu_topk=not on_gpu)
    with FakeTensorMode():
        with torch.device("cpu"):
            model = ARCHS[resolved.arch](resolved)
        params = [p for p in model.parameters() if p.requires_grad]
        lay = ParamLayout(model, weight_decay=o.weight_decay, exclude_norm_bias=o.exclude_norm_bias)
        part = build_partition(lay, world, o.partitioner)
        rank = max(range(world), key=lambda r: part.ranges[r][1] - part.ranges[r][0])
        tracker.track(params, "params")
        with tracker:
            tracker.category = "state"
            comm = PlanComm(rank, world)
            comm.offers_all_to_all = all_to_all
            strategy = ScapeStrategy(o, model, comm=comm)
            buf = strategy.grad_buffer      # flat_grads: the gradients' row, not SCAPE state
            grad_bytes = 0 if buf is None else tracker.storage_bytes(buf.buffer.untyped_storage())
            peaks = []
            for step in range(1, 4):
                tracker.category = "gradients"
                if buf is None:             # what backward leaves: one gradient per parameter
                    for p in params:
                        p.grad = torch.zeros_like(p)
                else:                       # it accumulates into the buffer's views
                    buf.mark_written()
                strategy.before_forward(step)
                base = tracker.live
                tracker.peak, tracker.category = base, "step"
                strategy.step(1e-4)
                peaks.append((tracker.peak - base, tracker.peak_what))
                tracker.category = "gradients"
                strategy.zero_grad()
                if buf is None:
                    for p in params:
                        p.grad = None
            held = tracker.live - tracker.by_category["params"] - grad_bytes
            assert (strategy.last_engine is strategy.fused) == (o.scape_impl == "fused"), \
                f"the traced density does not select the {o.scape_impl} path"
            strategy.close()
    step, where = peaks[-1]
    return StepMemory(held=held, step=step, where=where, density=density)


def trace_quantized_all_reduce(numel: int, world: int, payload_dtype: str, on_gpu: bool,
                               chunk: int, error_feedback: float = 0.0,
                               all_to_all: bool = True) -> int:
    """The bytes DiLoCo's quantized outer all-reduce (``optim/local/diloco.py``:
    ``strategy.outer_payload_dtype``, ``outer_payload_chunk``, ``outer_error_feedback``) of
    ``numel`` fp32 values allocates at its peak beyond its input and error feedback, traced on
    fake tensors as rank 0 of ``world``; without ``all_to_all`` (across torchft's replica
    groups) its all-gather form. Every chunk allocates alike, so one chunk is traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scape_train.optim.local.diloco import quantized_average_
    from scape_train.optim.scape.payload import PayloadCodec

    numel = min(numel, chunk)
    tracker = LiveBytes(CUDA_BLOCK if on_gpu else 1)
    with FakeTensorMode():
        x = torch.empty(numel, dtype=torch.float32, device="cpu")
        error = torch.empty_like(x) if error_feedback > 0 else None
        tracker.track([x] + ([error] if error is not None else []), "input")
        base = tracker.live
        with tracker:
            tracker.peak = base
            comm = PlanComm(0, world)
            comm.offers_all_to_all = all_to_all
            quantized_average_(x, comm, PayloadCodec(payload_dtype), kind="outer",
                               chunk=chunk, error=error, error_feedback=error_feedback)
    return tracker.peak - base
