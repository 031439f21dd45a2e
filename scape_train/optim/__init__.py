"""Optimizer strategies by name: ``build_optimizer(cfg, model, comm)``.

    adamw       dense DDP + torch AdamW (foreach)
    adams       dense DDP + AdamS (one state per parameter)
    scape       SCAPE: AdamS momentum top-k with error feedback, no DDP (replicated or sharded)
    topk_adamw  raw-gradient top-k with error feedback + AdamW (DGC-like baseline)
    powersgd    DDP + torch's PowerSGD comm hook + AdamW
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .adams import BIAS_CORRECTIONS
from .base import OptimizerStrategy
from scape_train.comm import Comm
from .config import OptimizerConfig
from .density import SCHEDULES
from .scape.mask_format import MASK_CODINGS
from .scape.partition import PARTITIONERS
from .scape.payload import PAYLOAD_DTYPES


def _adamw(cfg, model, comm, total_steps):
    from .dense import DenseStrategy
    return DenseStrategy(cfg, model, comm, adams=False)


def _adams(cfg, model, comm, total_steps):
    from .dense import DenseStrategy
    return DenseStrategy(cfg, model, comm, adams=True)


def _scape(cfg, model, comm, total_steps):
    from .scape.strategy import ScapeStrategy
    return ScapeStrategy(cfg, model, comm, total_steps=total_steps)


def _topk(cfg, model, comm, total_steps):
    from .topk import TopKAdamWStrategy
    return TopKAdamWStrategy(cfg, model, comm, total_steps=total_steps)


def _powersgd(cfg, model, comm, total_steps):
    from .powersgd import PowerSGDStrategy
    return PowerSGDStrategy(cfg, model, comm)


OPTIMIZERS: dict[str, Callable[[OptimizerConfig, nn.Module, Comm, int], OptimizerStrategy]] = {
    "adamw": _adamw, "adams": _adams, "scape": _scape, "topk_adamw": _topk,
    "powersgd": _powersgd,
}


def validate(cfg: OptimizerConfig) -> None:
    """Raise ValueError naming the field, the bad value and what is allowed."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(f"optimizer config: {msg}")

    need(cfg.name in OPTIMIZERS,
         f"unknown optimizer name {cfg.name!r}; valid names: {sorted(OPTIMIZERS)}")
    need(cfg.lr >= 0 and cfg.min_lr >= 0, f"lr and min_lr must be >= 0, got {cfg.lr}, {cfg.min_lr}")
    need(len(cfg.betas) == 2 and all(0.0 <= b < 1.0 for b in cfg.betas),
         f"betas must be two values in [0, 1), got {list(cfg.betas)}")
    need(cfg.eps >= 0, f"eps must be >= 0, got {cfg.eps}")
    need(cfg.name != "scape" or cfg.eps > 0,
         "scape needs eps > 0 (off-mask coordinates have v = 0 denominators once m decays)")
    need(cfg.weight_decay >= 0, f"weight_decay must be >= 0, got {cfg.weight_decay}")
    need(cfg.clip_grad >= 0, f"clip_grad must be >= 0 (0 = off), got {cfg.clip_grad}")
    need(cfg.bias_correction in BIAS_CORRECTIONS,
         f"bias_correction must be one of {list(BIAS_CORRECTIONS)}, got {cfg.bias_correction!r}")
    need(0.0 < cfg.density <= 1.0,
         f"density must be in (0, 1] (0.1 = 90% sparsity, 0.01 = 99%), got {cfg.density}")
    need(cfg.density_warmup_steps >= 0,
         f"density_warmup_steps must be >= 0, got {cfg.density_warmup_steps}")
    need(cfg.density_start_step >= 0 and cfg.density_cooldown_steps >= 0,
         f"density_start_step and density_cooldown_steps must be >= 0, got "
         f"{cfg.density_start_step}, {cfg.density_cooldown_steps}")
    need(cfg.mask_hysteresis >= 0.0,
         f"mask_hysteresis must be >= 0 (0: the spec's statistic), got {cfg.mask_hysteresis}")
    need(cfg.density_schedule in SCHEDULES,
         f"density_schedule must be one of {list(SCHEDULES)}, got {cfg.density_schedule!r}")
    need(cfg.partitioner in PARTITIONERS,
         f"partitioner must be one of {list(PARTITIONERS)}, got {cfg.partitioner!r}")
    need(cfg.offload_chunk_numel > 0,
         f"offload_chunk_numel must be > 0, got {cfg.offload_chunk_numel}")
    need(cfg.use_triton in ("auto", "on", "off"),
         f"use_triton must be auto, on or off, got {cfg.use_triton!r}")
    need(cfg.mask_coding in MASK_CODINGS,
         f"mask_coding must be one of {list(MASK_CODINGS)}, got {cfg.mask_coding!r}")
    need(cfg.scape_impl in ("fused", "reference"),
         f"scape_impl must be fused or reference, got {cfg.scape_impl!r}")
    need(cfg.payload_dtype in PAYLOAD_DTYPES,
         f"payload_dtype must be one of {list(PAYLOAD_DTYPES)}, got {cfg.payload_dtype!r}")
    need(cfg.payload_dtype == "fp32" or cfg.name == "scape",
         f"payload_dtype={cfg.payload_dtype} applies only to optimizer scape")
    need(cfg.powersgd_rank >= 1, f"powersgd_rank must be >= 1, got {cfg.powersgd_rank}")
    need(cfg.powersgd_start_iter >= 2,
         f"powersgd_start_iter must be >= 2 (torch's hook needs it with error feedback), "
         f"got {cfg.powersgd_start_iter}")
    need(not cfg.sharded or cfg.name == "scape", "sharded=true applies only to optimizer scape")
    need(not cfg.offload_residuals or cfg.name == "scape",
         "offload_residuals=true applies only to optimizer scape")


def build_optimizer(cfg: OptimizerConfig, model: nn.Module, comm: Comm | None = None,
                    total_steps: int = 0) -> OptimizerStrategy:
    """The strategy named by ``cfg.name`` over ``model`` (build before ``wrap_model``).
    ``total_steps``: the run's length, which places a density cooldown at its end."""
    validate(cfg)
    return OPTIMIZERS[cfg.name](cfg, model, comm if comm is not None else Comm(), total_steps)


ELASTIC = ("adamw", "adams", "scape")   # what data parallelism across replica groups carries


def validate_elastic_optimizer(cfg: OptimizerConfig) -> None:
    """The optimizer of ``strategy=data_parallel strategy.elastic.enabled=true``."""
    if cfg.name not in ELASTIC:
        raise ValueError(f"strategy.elastic.enabled=true with strategy=data_parallel carries the "
                         f"optimizers {list(ELASTIC)}, not optimizer={cfg.name}: use one of them, "
                         "or a local-step strategy (strategy=diloco, gasloc or sparseloco)")
    if cfg.name == "scape":
        from .scape.elastic import validate_elastic_scape
        validate_elastic_scape(cfg)


def build_elastic_optimizer(cfg: OptimizerConfig, model: nn.Module, comm: Comm, worker: int,
                            total_steps: int = 0) -> OptimizerStrategy:
    """Data parallelism across torchft replica groups (``comm``: the worker's ``ReplicaComm``;
    ``worker``: its slot), every step a round: the dense optimizers
    (``optim/elastic_dense.py``) or SCAPE (``optim/scape/elastic.py``)."""
    validate(cfg)
    validate_elastic_optimizer(cfg)
    if cfg.name == "scape":
        from .scape.elastic import ElasticScapeStrategy
        return ElasticScapeStrategy(cfg, model, comm, worker, total_steps=total_steps)
    from .elastic_dense import ElasticDenseStrategy
    return ElasticDenseStrategy(cfg, model, comm)


__all__ = ["ELASTIC", "OPTIMIZERS", "OptimizerConfig", "OptimizerStrategy",
           "build_elastic_optimizer", "build_optimizer", "validate", "validate_elastic_optimizer"]
