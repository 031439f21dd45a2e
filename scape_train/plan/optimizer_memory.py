"""Optimizer state and optimizer-step transients, from the parameter layout (exact functions of it).

``optimizer_memory(cfg, model, world, on_gpu)`` returns the device bytes each strategy holds for the
whole run (its state), what it keeps in host memory instead, and the extra bytes at the peak of
``strategy.step()`` and of ``strategy.state_dict()`` (checkpoints). The steps are replayed from the
code (``simulate.Replay``; SCAPE's step is traced from the code itself), so the temporaries
alive together are the ones the code keeps together:

- dense (``optim/dense.py``): AdamW 2 fp32 buffers (foreach: a sqrt(v) list per param group while it
  updates), AdamS 1 (``adams_update_`` builds v per tensor); under DDP (world > 1) the gradients are
  views of its buckets (``flat_grads``), held through the forward too like SCAPE's flat buffer
  (off: the buckets are a second copy of every gradient).
- SCAPE (``optim/scape/``): replicated holds m and the residual e full size (e in host memory with
  ``offload_residuals``) and the masks; sharded holds m and rho on its own flat range and e full
  size. Its step is traced from the code on fake tensors (``plan/scape_step.py``): the
  reference step at the schedule's peak density (it runs while a mask holds more than half the
  parameters, a density warm-up's start, and with ``scape_impl=reference``), and the fused step
  (``optim/scape/fused.py``) at the largest density it runs at, with the index vectors and
  decode tables it holds as state. Only the checkpoint's transients are replayed by hand.
- DiLoCo / GASLoC (``optim/local/``): the inner optimizer's state plus theta0 and y_prev (in host
  memory with ``outer_state_on_cpu``); a round adds flat buffers (GASLoC: one per peer), held
  as state from a round's end to its landing where rounds overlap (``overlap_steps``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn

from scape_train.config import Config
from scape_train.optim.adams_foreach import slices
from scape_train.optim.density import DensitySchedule, segment_k
from scape_train.optim.dense import adams_impl
from scape_train.optim.local.fragments import fragments
from scape_train.optim.local.sparseloco import MessageLayout
from scape_train.optim.scape.payload import PayloadCodec
from scape_train.plan.simulate import Replay

F32 = 4          # bytes of an fp32 element
I64 = 8          # bytes of an int64 index


@dataclass
class OptimizerMemory:
    state: list[tuple[str, int]] = field(default_factory=list)   # device, the whole run
    host: list[tuple[str, int]] = field(default_factory=list)    # host memory instead of device
    step: int = 0                 # extra device bytes at the peak of step()
    step_where: str = ""
    checkpoint: int = 0           # extra device bytes at the peak of state_dict()
    checkpoint_where: str = ""
    # the gradients live for the whole step (a persistent flat buffer: SCAPE's flat_grads, DDP's
    # buckets), not from their layer's backward on; autograd makes each one before adding it into
    # the buffer, so the largest of them is alive beside the buffer for a moment (``grads_transient``)
    grads_persistent: bool = False
    grads_transient: int = 0


@dataclass(frozen=True)
class _Params:
    numels: list[int]
    ndims: list[int]
    names: list[str]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def largest(self) -> int:
        return max(self.numels)


def _params(model: nn.Module) -> _Params:
    ps = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return _Params([p.numel() for _, p in ps], [p.ndim for _, p in ps], [n for n, _ in ps])


# -- dense inner optimizers ------------------------------------------------------------------------
def _adam_state(name: str, n: int) -> list[tuple[str, int]]:
    if name == "adams":
        return [("AdamS exp_avg (fp32)", F32 * n)]
    return [("AdamW exp_avg + exp_avg_sq (fp32)", 2 * F32 * n)]


def _largest_slice(p: _Params) -> int:
    """The most elements one ``_foreach`` call of the CPU's AdamS holds (its slices of each
    param group, the trainer's decay / no-decay split)."""
    groups = [tuple(n for n, d in zip(p.numels, p.ndims) if d >= 2),
              tuple(n for n, d in zip(p.numels, p.ndims) if d < 2)]
    return max((sum(b - a for _, a, b in sl) for g in groups for sl in slices(g)), default=0)


def _adam_step(r: Replay, name: str, p: _Params, o, on_gpu: bool, scaled_grads: bool) -> None:
    """The temporaries of one AdamW / AdamS step, for the implementation the device runs
    (``optim.dense.build_local_optimizer``); clip_grad_norm_'s are per-tensor scalars.
    ``scaled_grads``: the clipping coefficient is applied as AdamS reads g (dense AdamS)."""
    decay = sum(n for n, d in zip(p.numels, p.ndims) if d >= 2)
    group = max(decay, p.total - decay)      # the larger of the two param groups (decay or not)
    if name == "adams":
        impl = adams_impl(o)
        if impl == "auto":
            impl = "triton" if on_gpu else "foreach"
        if impl == "triton":      # one kernel reads theta, g, m and writes theta, m: no temporaries
            return
        # v = m^2*beta2 + (1-beta2) g^2; "official" divides m by bc1 first; g*coef where clipped
        copies = 1 + (o.bias_correction == "official") + scaled_grads
        if impl == "foreach" and on_gpu:   # each _foreach op makes its result for the whole group
            r.spike(copies * F32 * group, "AdamS foreach temporaries of a param group")
        elif impl == "foreach":            # the CPU's: one slice at a time
            r.spike(copies * F32 * _largest_slice(p), "AdamS foreach temporaries of a slice")
        else:
            r.spike(copies * F32 * p.largest, "AdamS v of the largest tensor")
    elif on_gpu and o.foreach:    # torch's fused AdamW: one kernel, no temporaries
        return
    elif o.foreach:               # torch's _multi_tensor_adam: sqrt(exp_avg_sq) for a whole param group
        r.spike(F32 * group, "AdamW foreach sqrt(v) of a param group")
    else:                         # _single_tensor_adam: sqrt(v), its quotient and the addcdiv term
        r.spike(3 * F32 * p.largest, "AdamW sqrt(v) of the largest tensor")


def _dense(cfg: Config, p: _Params, world: int, on_gpu: bool) -> OptimizerMemory:
    o = cfg.optimizer
    inner = "adams" if o.name == "adams" else "adamw"
    mem = OptimizerMemory(state=_adam_state(inner, p.total))
    if world > 1:
        if o.flat_grads:    # p.grad are views of DDP's buckets: the gradients are the buckets
            mem.grads_persistent, mem.grads_transient = True, F32 * p.largest
        else:
            mem.state.append(("DDP gradient buckets (fp32)", F32 * p.total))
        if o.name == "powersgd":
            mem.state.append(("PowerSGD error feedback (fp32)", F32 * p.total))
    r = Replay()
    if cfg.strategy.elastic.enabled:   # optim/elastic_dense.py: the gradients averaged in one
        r.alloc(F32 * p.total, "flat gradients, all-reduced across replica groups")   # buffer
    _adam_step(r, inner, p, o, on_gpu, scaled_grads=o.clip_grad > 0)
    mem.step, mem.step_where = r.peak, r.where
    return mem


# -- SCAPE -----------------------------------------------------------------------------------------
def _scape(cfg: Config, model: nn.Module, world: int, on_gpu: bool) -> OptimizerMemory:
    from scape_train.optim.scape.kernels import packed_numel
    from scape_train.optim.scape.partition import ParamLayout, build_partition

    o = cfg.optimizer
    lay = ParamLayout(model, weight_decay=o.weight_decay, exclude_norm_bias=o.exclude_norm_bias)
    part = build_partition(lay, world, o.partitioner)
    n = lay.total
    # The largest payload: the schedule's peak density (a warm-up starts from dense).
    d = DensitySchedule.of(o, cfg.trainer.max_steps).peak()

    rank = max(range(world), key=lambda r: part.ranges[r][1] - part.ranges[r][0])
    lo, hi = part.ranges[rank]
    n_own = hi - lo
    from scape_train.optim.scape.mask_coding import MaskPlan
    from scape_train.optim.scape.masks import mask_counts

    # the next mask's coded all-gather buffer, as the configured coding sizes it; a mask known to
    # be all ones is not sent at all and is held decoded (1 byte per element) instead
    coded = MaskPlan(part, lay, [] if o.mask_coding == "bitmap" else mask_counts(part, lay, d),
                     o.mask_coding, n).shard_bytes
    shard_bytes = coded if coded else max(1, max(packed_numel(hi_ - lo_) for lo_, hi_ in part.ranges))
    in_flight = shard_bytes * world if coded else n

    mem = OptimizerMemory()
    if o.sharded:
        mem.state += [(f"SCAPE momentum m (own 1/{world}, fp32)", F32 * n_own),
                      (f"SCAPE shared residual rho (own 1/{world}, fp32)", F32 * n_own)]
    else:
        mem.state.append(("SCAPE momentum m (full, fp32)", F32 * n))
    residual = ("SCAPE residual e (full, fp32)", F32 * n)
    if o.offload_residuals and on_gpu:
        mem.host.append(residual)
        mem.state.append(("SCAPE offload staging (2 chunks)", 2 * F32 * min(o.offload_chunk_numel, n)))
    else:
        mem.state.append(residual)     # on a CPU run "host" is the device
    mem.state.append(("SCAPE masks (current bool + next, packed)", n + in_flight))

    mem.grads_persistent = o.flat_grads
    mem.grads_transient = F32 * max(lay.numels) if o.flat_grads else 0
    # the reference step, traced from the code at the schedule's peak density (the fused path
    # replaces it below wherever the run takes the fused step first)
    from scape_train.plan.scape_step import trace_step
    ref = trace_step(cfg, cfg.model, _plan_vocab(cfg), world, d, on_gpu, engine="reference")
    mem.step, mem.step_where = ref.step, f"reference step at density {d:.3g}: {ref.where}"
    _fused_path(cfg, model, world, on_gpu, mem, n)
    if cfg.strategy.elastic.enabled:    # optim/scape/elastic.py: kept until the step's vote
        as_params = sum(p.numel() * p.element_size() for p in lay.params)
        mem.state.append(("elastic rollback copy (θ, gradients, m, e)",
                          2 * as_params + 2 * F32 * n))

    ck = Replay()                       # state_dict(), in its order (scape/strategy.py)
    if o.sharded:
        owned = F32 * max(hi_ - lo_ for lo_, hi_ in part.ranges) * (world + 1)  # shard + gathered
        for what in ("m", "rho"):
            with ck.temp(owned, f"gathering {what} for the checkpoint"):
                ck.alloc(F32 * n, f"gathering {what} for the checkpoint")
    else:
        ck.alloc(F32 * n, "momentum copy for the checkpoint")
    ck.alloc(F32 * n, "residual copy for the checkpoint")
    # Per-tensor copies: .cpu().clone() is a second copy where the device is the host.
    split = 0 if on_gpu else F32 * n
    ck.alloc(2 * split, "per-tensor checkpoint copies")
    packed = 0 if on_gpu else packed_numel(n)
    ck.spike(2 * max(lay.numels), "packing the masks for the checkpoint")
    ck.alloc(packed, "packing the masks for the checkpoint")
    _assemble_mask(ck, part, in_flight)  # mask_next: waits for the in-flight gather
    ck.spike(2 * max(lay.numels), "packing the masks for the checkpoint")
    ck.alloc(packed, "packing the masks for the checkpoint")
    if o.sharded:
        ck.alloc(split, "per-tensor checkpoint copies")
    mem.checkpoint, mem.checkpoint_where = ck.peak, ck.where
    return mem


def fused_densities(cfg: Config, n: int, counts_at) -> list[float]:
    """Every density at which a run of ``cfg`` takes the fused step (``accepts``: its mask
    holds at most FUSED_MAX_FRACTION of the ``n`` parameters), largest first; none if it never
    does (a warm-up falls through them, a cooldown rises through them)."""
    from scape_train.optim.scape.fused import FUSED_MAX_FRACTION, fuses
    o = cfg.optimizer
    if o.scape_impl != "fused" or not fuses(o.offload_residuals):
        return []
    schedule = DensitySchedule.of(o, cfg.trainer.max_steps)
    return [d for d in sorted({schedule.at(t) for t in schedule.changing_steps()}, reverse=True)
            if counts_at(d) <= FUSED_MAX_FRACTION * n]


def _fused_path(cfg: Config, model: nn.Module, world: int, on_gpu: bool, mem: OptimizerMemory,
                n: int) -> None:
    """Where the run takes the fused step: its state and step traced from the code
    (:mod:`.scape_step`), at the largest fused density and, where the torch decode runs, at the
    largest whose mask coding has per-one segments (indices or Elias-Fano: their decode tables
    and temporaries are index-sized, a bitmap's are not). The fused engine's index vectors and decode tables are state from its
    first fused step on; the plan adds them to every step (an over-estimate of the warm-up's
    reference steps, which run before they exist). Where the density changes between fused steps
    (a warm-up, a cooldown), each step of the torch decode builds its mask plan's tables anew:
    the step's figure includes them too."""
    from scape_train.optim.scape.mask_coding import MaskPlan
    from scape_train.optim.scape.mask_format import BITMAP
    from scape_train.optim.scape.masks import mask_counts
    from scape_train.optim.scape.partition import ParamLayout, build_partition
    from scape_train.plan.scape_step import trace_step

    o = cfg.optimizer
    lay = ParamLayout(model, weight_decay=o.weight_decay, exclude_norm_bias=o.exclude_norm_bias)
    part = build_partition(lay, world, o.partitioner)

    def ones(d: float) -> int:
        return sum(seg.numel if lay.excluded[seg.tensor] else segment_k(seg.numel, d)
                   for segs in part.segments for seg in segs)

    def per_one(d: float) -> bool:
        if o.mask_coding == "bitmap":
            return False
        kinds = MaskPlan(part, lay, mask_counts(part, lay, d), o.mask_coding, n).kinds()
        return any(kind not in ("all", BITMAP) for kind in kinds)

    densities = fused_densities(cfg, n, ones)
    # the torch decode (the CPU's; a GPU's with use_triton=off) builds per-one tables per plan;
    # the Triton decode builds none
    torch_decode = not on_gpu or o.use_triton == "off"
    traced = densities[:1] + ([d for d in densities[1:] if per_one(d)][:1] if torch_decode else [])
    vocab = _plan_vocab(cfg)
    first = DensitySchedule.of(o, cfg.trainer.max_steps).at(1)
    state = sum(b for _, b in mem.state)
    held = 0
    for d in traced:
        fused = trace_step(cfg, cfg.model, vocab, world, d, on_gpu)
        held = max(held, fused.held)
        step = fused.step + (max(0, fused.held - state)
                             if torch_decode and len(densities) > 1 else 0)
        if d == first or step > mem.step:
            mem.step, mem.step_where = step, f"fused step at density {d:.3g}: {fused.where}"
    if held > state:
        mem.state.append(("SCAPE fused step: mask indices, index plans, decode tables",
                          held - state))


def _plan_vocab(cfg: Config) -> int:
    """The model's vocabulary as the plan builds it (estimate.planned_vocab)."""
    return cfg.model.vocab_size or cfg.data.tokenizer.vocab_size


def _assemble_mask(r: Replay, part, in_flight: int) -> None:
    """``MaskPlan.decode`` of the ``bitmap`` coding: each owner's bits unpacked (uint8 shifts), then one bool cat."""
    pieces = 0
    for lo, hi in part.ranges:
        r.spike(2 * (hi - lo), "unpacking the next mask")   # two of: >> , & 1, .bool() at a time
        pieces += r.alloc(hi - lo, "unpacking the next mask")
    r.alloc(sum(hi - lo for lo, hi in part.ranges), "assembling the next mask")
    r.free(pieces, in_flight)


# -- top-k AdamW -----------------------------------------------------------------------------------
def _topk(cfg: Config, p: _Params, world: int, on_gpu: bool) -> OptimizerMemory:
    o = cfg.optimizer
    d = DensitySchedule.of(o, cfg.trainer.max_steps).peak()
    ks = [n if (o.exclude_norm_bias and nd < 2) else segment_k(n, d) for n, nd in zip(p.numels, p.ndims)]
    k, n = sum(ks), p.total
    mem = OptimizerMemory(state=_adam_state("adamw", n) + [("top-k residual (fp32)", F32 * n),
                                                          ("previous selection (bool, overlap metric)", n)])
    r = Replay()
    r.alloc(F32 * n, "accumulated gradient g + e")
    cpu_topk = 0 if on_gpu else 16
    picks = 0
    for numel, kk in zip(p.numels, ks):
        if kk < numel:
            r.spike(F32 * numel + (F32 + I64) * kk + cpu_topk * numel, "top-k per tensor")
        picks += r.alloc(I64 * kk, "selected indices")
    r.alloc(I64 * k, "selected indices")
    r.free(picks)
    r.alloc(F32 * k, "selected values")
    with r.temp(4 * k, "int32 indices"):
        r.alloc(8 * k, "all-gather send buffer")
    r.alloc(8 * k * world, "all-gather receive buffer")
    r.alloc(F32 * n, "dense averaged gradient")
    r.spike(I64 * k, "index_add indices")
    r.alloc(F32 * n, "new gradients (the step's list still references the old ones)")
    _adam_step(r, "adamw", p, o, on_gpu, scaled_grads=False)
    mem.step, mem.step_where = r.peak, r.where
    if not on_gpu:                       # the residual's .cpu().clone() where the device is the host
        mem.checkpoint, mem.checkpoint_where = F32 * n, "residual copy for the checkpoint"
    return mem


# -- DiLoCo / GASLoC -------------------------------------------------------------------------------
def gossip_peers(topology: str, world: int) -> int:
    if world <= 1:
        return 0
    if topology == "complete":
        return world - 1
    if topology == "1peer" or world == 2:
        return 1
    return 2


def in_flight_buffers(s, n: int, world: int) -> list[tuple[str, int]]:
    """The flat buffers an overlapped round (``strategy.overlap_steps`` > 0) holds from its
    exchange's start to its landing, tau inner steps into the next round (through their
    forward and backward): DiLoCo's drift (an all-reduce round), or a gossip round's sent point,
    the ablation's momentum term and one receive buffer per peer; with ``carry`` this worker's
    own drift of the round. A blocking round holds them inside its step only."""
    if s.name == "sparseloco":
        m = sparseloco_layout(s, n).message_bytes
        out = [("SparseLoCo message sent", m), ("SparseLoCo messages gathered", world * m)]
    elif all_reduce_round(s):
        out = [("flat outer gradient delta", F32 * n)]
    else:
        out = [("flat gossip send buffer", F32 * n)]
        if not s.mix_momentum:
            out.append(("flat momentum term", F32 * n))
        out.append(("gossip receive buffers (one per peer)", gossip_peers(s.topology, world) * F32 * n))
    if s.overlap_steps > 0 and s.overlap_merge == "carry":
        out.append(("own drift of the round (carry)", F32 * n))
    return out


def sparseloco_layout(s, n: int) -> MessageLayout:
    return MessageLayout.of(n, s.sparse_chunk, s.sparse_topk, PayloadCodec(s.sparse_payload_dtype))


def _sparseloco_round(r: Replay, s, n: int, big: int, world: int, fetch: int,
                      buffers: list[tuple[str, int]]) -> None:
    """SparseLoCo's round (``optim/local/sparseloco.py``), after the inner step: the drift into
    the error feedback, the top-k of every chunk, the message; then (blocking) the gathered
    messages summed into one flat delta and DiLoCo's outer step on it. Elastic rounds (blocking)
    hold a copy of the error feedback through the round, put back if the round fails."""
    lay = sparseloco_layout(s, n)
    kept = r.alloc(F32 * lay.padded, "error feedback before the round (elastic)") \
        if s.elastic.enabled else 0
    with r.temp(F32 * n, "flat drift"):
        r.spike(F32 * big + fetch, "drift of the largest tensor")
        # |e| beside top-k's values and positions; then the positions, the picked values, their
        # decoded copy and its negation beside the message
        r.spike(F32 * lay.padded + (F32 + I64) * lay.sent, "top-k of every chunk of |e|")
        with r.temp(I64 * lay.sent + 3 * F32 * lay.sent, "picked positions and values"):
            r.spike(lay.message_bytes + 2 * lay.sent, "the message and its int16 positions")
    if s.overlap_steps == 0:   # blocking: inside the step (overlapped: state until it lands)
        for what, b in buffers:
            r.alloc(b, what)
        r.free(buffers[0][1])      # the sent message, once the all-gather returned
    # the landing (a later step when overlapped): the lists summed, then the outer step
    r.alloc(F32 * lay.padded, "gathered lists summed (flat delta)")
    r.spike((I64 + F32) * lay.sent, "one worker's positions and values")
    r.spike(4 * F32 * big + fetch, "outer step of the largest tensor")
    r.free(kept)


def _dense_round(r: Replay, s, n: int, big: int, fetch: int,
                 buffers: list[tuple[str, int]], world: int = 1, on_gpu: bool = False) -> None:
    """DiLoCo's round (an all-reduce) or a gossip round, after the inner step."""
    if s.overlap_steps == 0:   # a blocking round's, inside the step
        for what, b in buffers:
            r.alloc(b, what)
    kept = 0
    if all_reduce_round(s) and s.outer_payload_dtype != "fp32":
        from scape_train.plan.scape_step import trace_quantized_all_reduce
        elastic = s.elastic.enabled      # across replica groups: e copied aside; an all-gather
        if elastic and s.outer_error_feedback > 0 and not fetch:   # (fetch: e in host memory)
            kept = r.alloc(F32 * n, "outer error feedback before the round (elastic)")
        form = "all-gather, fp32 sum" if elastic else "all-to-all, fp32 sum, all-gather"
        r.spike(trace_quantized_all_reduce(n, world, s.outer_payload_dtype, on_gpu,
                                           s.outer_payload_chunk, s.outer_error_feedback,
                                           all_to_all=not elastic),
                f"{s.outer_payload_dtype} outer all-reduce ({form}) of "
                f"{min(n, s.outer_payload_chunk):,} values")
    if all_reduce_round(s):
        r.spike(F32 * big + fetch, "outer gradient of the largest tensor")
        # y, y - y_prev and x of this tensor beside the previous tensor's x (rebound only after)
        r.spike(4 * F32 * big + fetch, "Nesterov outer step of the largest tensor")
        r.free(kept)
    else:
        r.spike(4 * F32 * big + fetch, "local extrapolation of the largest tensor")
        r.alloc(F32 * n, "mixed parameters")
        # once the round commits: y_prev <- y, recomputed tensor by tensor (theta0 - theta, y)
        r.spike(2 * F32 * big + fetch, "y_prev of the largest tensor (a committed round)")


def all_reduce_round(s) -> bool:
    """DiLoCo's round, which complete-graph GASLoC runs too (``optim/local/gasloc.py``)."""
    return s.name == "diloco" or (s.topology == "complete" and s.mix_momentum)


def _local(cfg: Config, p: _Params, world: int, on_gpu: bool) -> OptimizerMemory:
    o, s = cfg.optimizer, cfg.strategy
    inner = "adams" if o.name == "adams" else "adamw"
    n, big = p.total, p.largest
    mem = OptimizerMemory(state=_adam_state(inner, n))
    outer = (f"{s.name} outer state theta0 + y_prev (fp32)", 2 * F32 * n)
    on_host = s.outer_state_on_cpu and on_gpu
    (mem.host if on_host else mem.state).append(outer)
    if s.name == "sparseloco":
        mem.state.append(("SparseLoCo error feedback (fp32, whole chunks)",
                          F32 * sparseloco_layout(s, n).padded))
    if all_reduce_round(s) and s.outer_payload_dtype != "fp32" and s.outer_error_feedback > 0:
        (mem.host if on_host else mem.state).append(
            ("outer error feedback (fp32)", F32 * n))
    r = Replay()
    _adam_step(r, inner, p, o, on_gpu, scaled_grads=False)
    fetch = 2 * F32 * big if on_host else 0          # theta0 and y_prev copied to the device
    # the round's part of the model: all of it, or (Streaming DiLoCo) one fragment; the plan
    # holds the worst one's buffers in flight and replays each one's round
    parts = ([list(range(len(p.numels)))] if s.fragments <= 1
             else fragments(p.names, p.numels, s.fragments))
    sizes = [(sum(p.numels[i] for i in part), max(p.numels[i] for i in part)) for part in parts]
    buffers = in_flight_buffers(s, max(size for size, _ in sizes), world)
    if s.overlap_steps > 0:   # held from the round's end to its landing: state, for the plan
        mem.state += [(f"overlapped round in flight: {what}", b) for what, b in buffers]
    if s.name == "sparseloco":
        _sparseloco_round(r, s, n, big, world, fetch, buffers)
    else:
        rounds = []
        for size, largest in sizes:
            each = copy.deepcopy(r)
            _dense_round(each, s, size, largest, 2 * F32 * largest if on_host else 0,
                         in_flight_buffers(s, size, world), world, on_gpu)
            rounds.append(each)
        r = max(rounds, key=lambda each: each.peak)
    mem.step, mem.step_where = r.peak, r.where
    if not on_gpu:   # snapshot() copies the state where the device is the host (at a round end,
        # where the trainer checkpoints, theta equals theta0 and is not copied)
        mem.checkpoint = sum(b for _, b in mem.state)
        mem.checkpoint_where = "host copies of the state (checkpoint)"
    return mem


def optimizer_memory(cfg: Config, model: nn.Module, world: int, on_gpu: bool) -> OptimizerMemory:
    """The memory of the strategy the trainer would build over ``model`` (a meta model will do)."""
    p = _params(model)
    if cfg.strategy.name != "data_parallel":
        return _local(cfg, p, world, on_gpu)
    name = cfg.optimizer.name
    if name == "scape":
        return _scape(cfg, model, world, on_gpu)
    if name == "topk_adamw":
        return _topk(cfg, p, world, on_gpu)
    return _dense(cfg, p, world, on_gpu)
