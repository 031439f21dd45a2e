"""The start-up summary: what this run is, printed once by rank 0 before the first step.

    scape_train: llama_tiny (llama, 4 layers, d_model 256, heads 4/2 kv) 7.34M parameters ...
      devices     cpu x 1 (world size 1), precision fp32
      batch       8 seqs x 256 tokens x 1 accumulation x 1 ranks = 2,048 tokens/step
      ...

The same figures go to the W&B run (config key ``startup``, and ``startup/*`` in its summary)
when one is active. ``startup_summary`` returns them as a flat dict (tests read it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def resolved_precision(precision: str, device: torch.device) -> str:
    """What ``trainer.precision`` means on ``device`` (the same rule as ``train.autocast_context``)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return precision


def _devices(device: torch.device, world: int) -> str:
    name = str(device.type)
    if device.type == "cuda":
        try:
            name = f"cuda ({torch.cuda.get_device_name(device)})"
        except (RuntimeError, AssertionError):  # pragma: no cover - no driver
            pass
    return f"{name} x {world} (world size {world})"


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _optimizer_line(cfg: Any) -> str:
    o, t = cfg.optimizer, cfg.trainer
    sched = t.lr_schedule + (f" (decay {t.decay_steps or '20%'})" if t.lr_schedule == "wsd" else "")
    line = (f"{o.name}, lr {o.lr:g} -> {o.min_lr:g}, {sched}, warm-up {t.warmup_steps} of "
            f"{t.max_steps} steps, weight decay {o.weight_decay:g}, clip {o.clip_grad:g}")
    return line


def _density_line(cfg: Any) -> str | None:
    o = cfg.optimizer
    if o.name not in ("scape", "topk_adamw"):
        return None
    sparsity = f"{(1 - o.density) * 100:.4g}% sparse"
    if o.density_schedule == "constant" or o.density_warmup_steps == 0:
        line = f"{o.density:g} ({sparsity})"
    else:
        line = (f"{o.density_schedule} from 1.0 to {o.density:g} ({sparsity}) over "
                f"{o.density_warmup_steps} steps")
    if o.density_start_step > 1:
        line = f"dense before step {o.density_start_step}, then " + line
    if o.density_cooldown_steps:
        line += f", back to 1.0 over the last {o.density_cooldown_steps} steps"
    if o.name == "scape":
        extras = [f"partitioner {o.partitioner}", "sharded state" if o.sharded else "replicated state"]
        if o.offload_residuals:
            extras.append("residuals offloaded to host")
        line += ", " + ", ".join(extras)
    return line


def _elastic_part(e: Any) -> str:
    return (f"elastic: replica {e.replica} of {e.slots} slots, lighthouse "
            f"{e.lighthouse or '$TORCHFT_LIGHTHOUSE'}, at least {e.min_replicas} per round, "
            f"a lost peer cut after {e.timeout_s:g}s")


def _strategy_line(cfg: Any) -> str | None:
    s = cfg.strategy
    if s.name == "data_parallel":
        if not s.elastic.enabled:
            return None
        exchange = ("SCAPE's payload all-reduce and next-mask all-gather"
                    if cfg.optimizer.name == "scape" else "the gradients' all-reduce")
        return (f"data_parallel across torchft replica groups, every step a round (a quorum, "
                f"{exchange}, a vote), optimizer {cfg.optimizer.name}; "
                + _elastic_part(s.elastic))
    h = f"H_i={list(s.inner_steps_per_worker)}" if s.inner_steps_per_worker else f"H={s.inner_steps}"
    rounds = max(1, cfg.trainer.max_steps // max(1, s.inner_steps // max(1, s.fragments)))
    line = (f"{s.name}, {h}, ~{rounds} rounds, topology {s.topology}, outer lr {s.outer_lr:g}, "
            f"momentum {s.outer_momentum:g}, inner optimizer {cfg.optimizer.name}")
    if s.fragments > 1:
        line += (f"; streaming: {s.fragments} fragments, one synchronized every "
                 f"{s.inner_steps // s.fragments} steps")
    if s.outer_payload_dtype != "fp32":
        line += f"; outer gradients as {s.outer_payload_dtype}"
        if s.outer_error_feedback > 0:
            line += f" with error feedback (beta {s.outer_error_feedback:g})"
    if s.round_budget_s > 0:
        line += f", round budget {s.round_budget_s:g}s"
    if s.name == "sparseloco":
        line += (f"; sends the top {s.sparse_topk} of every {s.sparse_chunk} values of its error "
                 f"feedback (decay {s.sparse_error_decay:g}) as {s.sparse_payload_dtype}")
    if s.elastic.enabled:
        line += "; " + _elastic_part(s.elastic)
    return line


def memory_plan_estimate(trainer: Any) -> str | None:
    """The memory plan's peak per rank (rank 0 plans; None with ``plan.check=off``)."""
    plan = getattr(trainer, "memory_plan", None)
    if plan is None:
        return None
    return plan.verdict()


def startup_summary(trainer: Any) -> dict[str, Any]:
    """The run's key figures as a flat dict (numbers where they are numbers)."""
    cfg, info, model = trainer.cfg, trainer.info, trainer.model
    m, t = model.cfg, cfg.trainer
    kv = m.n_kv_heads or m.n_heads
    out: dict[str, Any] = {
        "model": (f"{m.name} ({m.arch}, {m.n_layers} layers, d_model {m.d_model}, heads "
                  f"{m.n_heads}/{kv} kv, vocab {m.vocab_size}, context {m.max_seq_len})"),
        "params": model.num_params(),
        "params_non_embedding": model.num_params(exclude_embeddings=True),
        "devices": _devices(info.device, info.world_size),
        "world_size": info.world_size,
        "precision": resolved_precision(t.precision, info.device),
        "micro_batch_size": t.micro_batch_size,
        "seq_len": cfg.data.seq_len,
        "grad_accum": trainer.accum,
        "tokens_per_step": trainer.tokens_per_step,
        "optimizer": _optimizer_line(cfg),
        "run_dir": str(trainer.run_dir),
    }
    out["attention"] = _attention_line(trainer)
    for key, line in (("density", _density_line(cfg)), ("strategy", _strategy_line(cfg)),
                      ("memory_plan", memory_plan_estimate(trainer))):
        if line:
            out[key] = line
    if cfg.init_from:
        out["init_from"] = cfg.init_from
    if trainer.state.step:
        out["resumed_at_step"] = trainer.state.step
    if cfg.smoke.enabled:
        out["smoke"] = True
    return out


def _attention_line(trainer: Any) -> str:
    """The SDPA kernel the training forward takes under ``trainer.attention_backend``."""
    from scape_train.models.attention_backend import attention_backend, chosen_kernel

    m, t, info = trainer.model.cfg, trainer.cfg.trainer, trainer.info
    bf16 = resolved_precision(t.precision, info.device) == "bf16"
    with attention_backend(t.attention_backend):
        kernel = chosen_kernel(m.n_heads, m.n_kv_heads or m.n_heads, m.d_model // m.n_heads,
                               trainer.cfg.data.seq_len, info.device,
                               torch.bfloat16 if bf16 else torch.float32)
    return f"{kernel} (trainer.attention_backend={t.attention_backend})"


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"scape_train: {s['model']}: {_human(s['params'])} parameters "
             f"({_human(s['params_non_embedding'])} without embeddings)"]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<12}{text}")

    row("devices", f"{s['devices']}, precision {s['precision']}")
    row("batch", f"{s['micro_batch_size']} seqs x {s['seq_len']} tokens x {s['grad_accum']} "
                 f"accumulation x {s['world_size']} ranks = {s['tokens_per_step']:,} tokens/step")
    row("optimizer", s["optimizer"])
    for key in ("attention", "density", "strategy", "init_from", "resumed_at_step", "memory_plan"):
        if key in s:
            row(key.replace("_", " "), str(s[key]))
    row("run dir", s["run_dir"])
    return "\n".join(lines)


def report_startup(trainer: Any, wandb_run: Any = None) -> dict[str, Any]:
    """Rank 0: print the summary once and record it in the W&B run (if any)."""
    summary = startup_summary(trainer)
    print(format_summary(summary), flush=True)
    if wandb_run is not None:
        try:
            wandb_run.config.update({"startup": summary}, allow_val_change=True)
            wandb_run.summary.update({f"startup/{k}": v for k, v in summary.items()})
        except Exception as exc:  # noqa: BLE001 - W&B bookkeeping must never stop a run
            log.warning("could not record the start-up summary in W&B: %s", exc)
    return summary
