"""Local-step strategies (Hydra group ``strategy``): DiLoCo, GASLoC and SparseLoCo.

    build_local_strategy(strategy_cfg, optimizer_cfg, model, comm) -> OptimizerStrategy

``diloco``: H inner steps, then the outer gradient is all-reduced and a Nesterov outer step taken.
``gasloc``: H_i inner steps, a local Nesterov extrapolation, then one gossip exchange with the peers
of a random graph (complete | 1peer | 2peer). The spec: /work/shared/spec/gasloc.md.
``sparseloco``: DiLoCo's rounds with an error feedback in place of the outer momentum; the top-k of
every chunk of it is all-gathered (``sparseloco.py``).
"""

from __future__ import annotations

from torch import nn

from ..base import OptimizerStrategy
from scape_train.comm import Comm
from ..config import OptimizerConfig
from ..scape.payload import PAYLOAD_DTYPES
from .config import ELASTIC_BACKENDS, StrategyConfig
from .diloco import DiLoCo
from .fragments import StreamingDiLoCo
from .gasloc import GASLoC
from .sparseloco import MAX_CHUNK, SparseLoCo
from .strategy import LocalStepStrategy
from .topology import TOPOLOGIES, mixing_matrix, peers, permutation

STRATEGIES = ("diloco", "gasloc", "sparseloco")
INNER_OPTIMIZERS = ("adamw", "adams")   # local, non-communicating


def validate(cfg: StrategyConfig, optimizer_cfg: OptimizerConfig, world_size: int) -> None:
    """Raise ValueError naming the field, the bad value and what is allowed."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"strategy config: {msg}")

    need(cfg.name in STRATEGIES,
         f"unknown local strategy {cfg.name!r}; valid: {list(STRATEGIES)} (data_parallel is "
         "built by scape_train.optim.build_optimizer, not here)")
    need(cfg.topology in TOPOLOGIES, f"unknown topology {cfg.topology!r}; valid: {list(TOPOLOGIES)}")
    need(cfg.name == "gasloc" or cfg.topology == "complete",
         f"{cfg.name} exchanges with every worker: topology must be complete, got "
         f"{cfg.topology!r} (use strategy=gasloc for 1peer / 2peer)")
    if cfg.name == "sparseloco":
        need(1 <= cfg.sparse_topk <= cfg.sparse_chunk <= MAX_CHUNK,
             f"sparseloco needs 1 <= sparse_topk <= sparse_chunk <= {MAX_CHUNK}, got "
             f"sparse_topk={cfg.sparse_topk}, sparse_chunk={cfg.sparse_chunk}")
        need(0.0 <= cfg.sparse_error_decay <= 1.0,
             f"sparse_error_decay (beta) must be in [0, 1], got {cfg.sparse_error_decay}")
        need(cfg.sparse_payload_dtype in PAYLOAD_DTYPES,
             f"sparse_payload_dtype must be one of {list(PAYLOAD_DTYPES)}, got "
             f"{cfg.sparse_payload_dtype!r}")
    need(cfg.outer_payload_dtype in PAYLOAD_DTYPES,
         f"outer_payload_dtype must be one of {list(PAYLOAD_DTYPES)}, got "
         f"{cfg.outer_payload_dtype!r}")
    if cfg.outer_payload_dtype != "fp32":
        need(cfg.name == "diloco", f"outer_payload_dtype={cfg.outer_payload_dtype} applies to "
             f"strategy=diloco (its outer all-reduce), not {cfg.name}")
        need(cfg.overlap_steps == 0,
             f"outer_payload_dtype={cfg.outer_payload_dtype} blocks (an all-to-all and an "
             "all-gather, or across replica groups one all-gather): set overlap_steps=0")
    need(cfg.outer_payload_chunk >= 1,
         f"outer_payload_chunk must be >= 1 value, got {cfg.outer_payload_chunk}")
    need(0.0 <= cfg.outer_error_feedback <= 1.0,
         f"outer_error_feedback (beta) must be in [0, 1], got {cfg.outer_error_feedback}")
    need(cfg.outer_error_feedback == 0.0 or cfg.outer_payload_dtype != "fp32",
         f"outer_error_feedback={cfg.outer_error_feedback} feeds back the rounding of quantized "
         "outer gradients, and fp32 ones are not rounded: set strategy.outer_payload_dtype "
         "(e.g. fp4_e2m1) or leave outer_error_feedback at 0")
    need(cfg.inner_steps >= 0, f"inner_steps (H) must be >= 0, got {cfg.inner_steps}")
    per = list(cfg.inner_steps_per_worker)
    need(not per or len(per) == world_size,
         f"inner_steps_per_worker has {len(per)} entries but the world size is {world_size}: "
         "give one H_i per rank, or [] to use inner_steps everywhere")
    need(all(h >= 0 for h in per), f"inner_steps_per_worker entries must be >= 0, got {per}")
    need(cfg.round_budget_s >= 0, f"round_budget_s must be >= 0 (0 = fixed H), got {cfg.round_budget_s}")
    need(not (per and cfg.round_budget_s > 0),
         "set either inner_steps_per_worker (fixed H_i) or round_budget_s (adaptive H_i), not both")
    need(cfg.outer_lr > 0, f"outer_lr (eta) must be > 0, got {cfg.outer_lr}")
    need(0.0 <= cfg.outer_momentum < 1.0,
         f"outer_momentum (mu / gamma) must be in [0, 1), got {cfg.outer_momentum}")
    need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    need(cfg.max_rounds is None or cfg.max_rounds >= 1,
         f"max_rounds must be >= 1 or null, got {cfg.max_rounds}")
    need(0 <= cfg.overlap_steps and (cfg.overlap_steps == 0 or cfg.overlap_steps < cfg.inner_steps),
         f"overlap_steps (tau) must be in [0, inner_steps={cfg.inner_steps}): a round's exchange "
         f"lands before the next one starts; got {cfg.overlap_steps}")
    need(cfg.overlap_merge in ("carry", "mix"),
         f"overlap_merge must be carry or mix, got {cfg.overlap_merge!r}")
    need(0.0 <= cfg.overlap_local_weight <= 1.0,
         f"overlap_local_weight (alpha) must be in [0, 1], got {cfg.overlap_local_weight}")
    need(cfg.overlap_local_weight == 0.0 or cfg.overlap_merge == "mix",
         "overlap_local_weight is mix's alpha: set strategy.overlap_merge=mix with it")
    if cfg.fragments != 1:
        need(cfg.fragments > 1, f"fragments must be >= 1, got {cfg.fragments}")
        need(cfg.name == "diloco", f"fragments={cfg.fragments} (Streaming DiLoCo) applies to "
             f"strategy=diloco, not {cfg.name}")
        need(cfg.inner_steps % cfg.fragments == 0,
             f"fragments={cfg.fragments} must divide inner_steps={cfg.inner_steps}: one fragment "
             "is synchronized every inner_steps / fragments steps")
        need(not per and cfg.round_budget_s <= 0,
             "fragments > 1 takes one H for every worker: drop inner_steps_per_worker and "
             "round_budget_s")
        need(cfg.overlap_steps < cfg.inner_steps // cfg.fragments,
             f"overlap_steps (tau) must be < inner_steps / fragments = "
             f"{cfg.inner_steps // cfg.fragments} with fragments: a fragment's exchange lands "
             f"before the next fragment's round; got {cfg.overlap_steps}")
    need(cfg.overlap_steps == 0 or not cfg.elastic.enabled,
         "overlap_steps > 0 with strategy.elastic: an elastic round commits by a vote after its "
         "exchange, which an overlapped round would take steps later; set overlap_steps=0")
    if cfg.elastic.enabled:
        validate_elastic(cfg, world_size)
    need(optimizer_cfg.name in INNER_OPTIMIZERS,
         f"the inner optimizer of {cfg.name} must not communicate: optimizer.name must be one of "
         f"{list(INNER_OPTIMIZERS)}, got {optimizer_cfg.name!r}")


def validate_elastic(cfg: StrategyConfig, world_size: int) -> None:
    """The ``strategy.elastic`` block of an enabled elastic run."""
    el = cfg.elastic

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"strategy.elastic: {msg}")

    need(world_size == 1,
         f"each elastic worker is one process (one replica group), but this one has world size "
         f"{world_size}: start every worker as its own `python -m scape_train` with its own "
         "strategy.elastic.replica, not under torchrun")
    need(el.slots >= 1 and 0 <= el.replica < el.slots,
         f"replica={el.replica} must be in [0, slots={el.slots}): slots is the number of data "
         "shards (the most workers at once), replica this worker's shard and name")
    need(el.min_replicas >= 1, f"min_replicas must be >= 1, got {el.min_replicas}")
    need(el.backend in ELASTIC_BACKENDS,
         f"backend must be one of {list(ELASTIC_BACKENDS)}, got {el.backend!r}")
    need(el.timeout_s > 0 and el.quorum_timeout_s > 0 and el.connect_timeout_s > 0,
         f"timeouts must be > 0, got timeout_s={el.timeout_s}, quorum_timeout_s="
         f"{el.quorum_timeout_s}, connect_timeout_s={el.connect_timeout_s}")
    need(el.quorum_retries >= 0, f"quorum_retries must be >= 0, got {el.quorum_retries}")
    need(not cfg.inner_steps_per_worker,
         "inner_steps_per_worker is per rank and elastic ranks change with the quorum: use "
         "inner_steps, or round_budget_s for workers of different speeds")


def build_local_strategy(strategy_cfg: StrategyConfig, optimizer_cfg: OptimizerConfig,
                         model: nn.Module, comm: Comm, total_steps: int = 0,
                         broadcast_initial: bool = True) -> OptimizerStrategy:
    """DiLoCo, GASLoC or SparseLoCo over ``model`` (the model is not wrapped: no DDP). ``total_steps``: the
    run's length, where its last round ends (0: rounds of H to the end). ``broadcast_initial``:
    rank 0's parameters to every rank (all theta^i_0 equal); a resumed run, whose checkpoint
    sets them, skips it."""
    cfg = strategy_cfg
    validate(cfg, optimizer_cfg, comm.world)

    diloco_options = {"payload_dtype": cfg.outer_payload_dtype,
                      "payload_chunk": cfg.outer_payload_chunk,
                      "error_feedback": cfg.outer_error_feedback,
                      "rounds_can_fail": cfg.elastic.enabled}

    def make_outer(params, names):
        if cfg.name == "diloco" and cfg.fragments > 1:
            return StreamingDiLoCo(params, names, comm, cfg.outer_lr, cfg.outer_momentum,
                                   cfg.outer_state_on_cpu, count=cfg.fragments, **diloco_options)
        if cfg.name == "diloco":
            return DiLoCo(params, names, comm, cfg.outer_lr, cfg.outer_momentum,
                          cfg.outer_state_on_cpu, **diloco_options)
        if cfg.name == "sparseloco":
            return SparseLoCo(params, names, comm, cfg.outer_lr, cfg.outer_momentum,
                              cfg.outer_state_on_cpu, chunk=cfg.sparse_chunk,
                              topk=cfg.sparse_topk, error_decay=cfg.sparse_error_decay,
                              payload_dtype=cfg.sparse_payload_dtype,
                              rounds_can_fail=cfg.elastic.enabled)
        return GASLoC(params, names, comm, cfg.outer_lr, cfg.outer_momentum, cfg.outer_state_on_cpu,
                      topology=cfg.topology, seed=cfg.seed, mix_momentum=cfg.mix_momentum)

    return LocalStepStrategy(cfg, optimizer_cfg, model, comm, make_outer, total_steps,
                             broadcast_initial)


__all__ = ["DiLoCo", "GASLoC", "LocalStepStrategy", "SparseLoCo", "StreamingDiLoCo", "STRATEGIES", "StrategyConfig", "TOPOLOGIES",
           "build_local_strategy", "mixing_matrix", "peers", "permutation", "validate",
           "validate_elastic"]
