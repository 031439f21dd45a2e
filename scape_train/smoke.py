"""Smoke runs: any experiment, end to end, on a laptop or CI in well under a minute.

    python -m scape_train +experiment=llama500m_s99 +smoke=cpu

``configs/smoke/cpu.yaml`` sets the static part (the shipped classics text with a small trained
byte-level BPE, so nothing is downloaded; CPU, fp32; W&B offline) and the ``smoke`` node; this
module derives the rest from the experiment's own values once the world size is known
(``apply_smoke``, called by the trainer before validation):

kept        the optimizer (kind, lr, betas, clipping, sparsity, density schedule kind, sharding,
            partitioner, residual offload), the strategy (DiLoCo / GASLoC, topology, outer lr and
            momentum), the lr schedule kind, the architecture (GPT / Llama, tied, biases,
            grouped-query ratio), activation checkpointing, and the evaluation wiring (the same
            lm-eval tasks, offline: LAMBADA reads a cloze file built from the shipped text)
shrunk      model width/depth/heads, sequence length, micro-batch, gradient accumulation (at most
            ``max_accum``), steps, inner steps H (at most ``max_inner_steps``)
scaled      every step count that shapes the run keeps its FRACTION of the run: lr warm-up,
            WSD decay, density warm-up, PowerSGD start (a positive count stays >= 1). Validation
            and checkpoint intervals keep theirs but at most 4 per run (the real ones, a few
            hundredths of a run, would be every step), so that wiring also runs mid-run

The run is named ``<run_name>_smoke`` (W&B tag ``smoke``), so ``resume=auto`` of a real run never
picks up a smoke run's checkpoints.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

CLOZE_VERSION = 1


@dataclass
class SmokeConfig:
    enabled: bool = False             # set by configs/smoke/*.yaml
    max_steps: int = 24               # rounded up to whole rounds for DiLoCo / GASLoC
    n_layers: int = 2                 # the smoke model's blocks
    d_model: int = 64                 # ... its width
    n_heads: int = 4                  # ... its attention heads
    seq_len: int = 64                 # tokens per sequence
    micro_batch_size: int = 2         # sequences per rank per forward
    max_accum: int = 2                # gradient accumulation kept, at most this many micro-batches
    max_inner_steps: int = 4          # DiLoCo / GASLoC: H kept, at most this
    round_budget_s: float = 0.25      # a wall-clock round budget (straggler runs) becomes this
    eval_limit: int = 16              # lm-eval examples per task
    eval_batches: int = 2             # validation batches
    cache_dir: Optional[str] = None   # the LAMBADA-format cloze file; None = ~/.cache/scape_train/smoke


def _scaled(value: int, fraction_of: int, steps: int, floor: int = 0) -> int:
    """``value`` (a step count of a run of ``fraction_of`` steps) at the same fraction of
    ``steps``; a positive value stays >= 1 (and >= ``floor``); 0 stays 0 (off)."""
    if value <= 0:
        return value
    return max(1, floor, min(steps, round(value / fraction_of * steps)))


def _kv_heads(n_heads: int, n_kv_heads: int, new_heads: int) -> int:
    """The grouped-query ratio of the experiment at ``new_heads`` query heads."""
    if n_kv_heads in (0, n_heads):
        return 0
    kv = max(1, round(new_heads * n_kv_heads / n_heads))
    while new_heads % kv:
        kv -= 1
    return kv


def apply_smoke(cfg: Any, world_size: int = 1) -> Any:
    """A copy of ``cfg`` (a ``Config``) shrunk for a smoke run; ``cfg`` itself if smoke is off."""
    smoke: SmokeConfig = cfg.smoke
    if not smoke.enabled:
        return cfg
    cfg = copy.deepcopy(cfg)
    t, m, d, o, s = cfg.trainer, cfg.model, cfg.data, cfg.optimizer, cfg.strategy
    original = max(1, t.max_steps)
    steps = max(1, smoke.max_steps)

    # -- local-step strategies: H kept, at most max_inner_steps; whole rounds
    if s.name != "data_parallel":
        s.inner_steps = min(s.inner_steps, smoke.max_inner_steps) if s.inner_steps > 0 else 0
        s.inner_steps_per_worker = [min(h, smoke.max_inner_steps) for h in s.inner_steps_per_worker]
        if s.round_budget_s > 0:
            s.round_budget_s = smoke.round_budget_s
        h = max(1, s.inner_steps)
        steps = math.ceil(steps / h) * h
        if s.max_rounds is not None:
            s.max_rounds = steps // h

    # -- step counts at the same fraction of the run
    quarter = max(1, steps // 4)
    t.warmup_steps = _scaled(t.warmup_steps, original, steps)
    t.decay_steps = _scaled(t.decay_steps, original, steps)
    o.density_warmup_steps = _scaled(o.density_warmup_steps, original, steps)
    o.density_start_step = _scaled(o.density_start_step, original, steps)
    o.density_cooldown_steps = _scaled(o.density_cooldown_steps, original, steps)
    if o.name == "powersgd":   # torch's hook needs >= 2 with error feedback
        o.powersgd_start_iter = _scaled(o.powersgd_start_iter, original, steps, floor=2)
    # (the real intervals are a few hundredths of a run: every step here; a quarter is enough)
    t.eval_every = max(_scaled(t.eval_every, original, steps), quarter) if t.eval_every else 0
    t.checkpoint_every = (max(_scaled(t.checkpoint_every, original, steps), quarter)
                          if t.checkpoint_every else 0)
    t.log_every = min(t.log_every, quarter)
    t.stop_after = _scaled(t.stop_after, original, steps)
    t.max_steps = steps

    # -- batch: micro-batch shrunk, accumulation kept (capped)
    micro_before = t.micro_batch_size
    t.micro_batch_size = smoke.micro_batch_size
    if t.global_batch_size:
        accum = max(1, t.global_batch_size // max(1, micro_before * world_size))
        t.global_batch_size = t.micro_batch_size * world_size * min(accum, smoke.max_accum)
    t.eval_batches = smoke.eval_batches

    # -- model: same architecture, shrunk
    ratio = smoke.d_model / m.d_model
    m.n_kv_heads = _kv_heads(m.n_heads, m.n_kv_heads or m.n_heads, smoke.n_heads)
    m.n_layers, m.d_model, m.n_heads = smoke.n_layers, smoke.d_model, smoke.n_heads
    if m.ffn_dim:
        m.ffn_dim = max(16, round(m.ffn_dim * ratio / 16) * 16)
    m.max_seq_len = smoke.seq_len
    m.vocab_size = 0                  # follow the smoke tokenizer
    m.name = f"{m.name}_smoke"
    d.seq_len = smoke.seq_len

    # -- evaluation: the same tasks, offline and few examples
    e = cfg.eval
    if e.enabled:
        e.limit = smoke.eval_limit
        e.bootstrap_iters = 0
        local = dict(e.local_data or {})
        from scape_train.eval.tasks import expand_tasks

        if "lambada_openai" in expand_tasks(list(e.tasks)) and "lambada_openai" not in local:
            local["lambada_openai"] = str(classics_cloze_file(smoke.cache_dir))
        e.local_data = local

    cfg.run_name = f"{cfg.run_name}_smoke"
    tags = list(cfg.logging.wandb.tags)
    cfg.logging.wandb.tags = tags if "smoke" in tags else [*tags, "smoke"]
    if os.environ.get("RANK", "0") == "0":
        log.info("smoke run: %d steps (experiment: %d), warm-up %d, density warm-up %d, model %d x %d",
                 steps, original, t.warmup_steps, o.density_warmup_steps, m.n_layers, m.d_model)
    return cfg


# -- an offline LAMBADA-format file from the shipped text ---------------------------------------


def _cloze_passages(n: int = 64, words: int = 48) -> list[dict[str, str]]:
    """``n`` passages of ``words`` words from the shipped classics validation split, each ending
    on a plain word (the cloze target), in lm-eval's lambada_openai format ``{"text"}``."""
    from scape_train.data.sources import classics_dir

    out: list[dict[str, str]] = []
    with gzip.open(classics_dir() / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            tokens = json.loads(line)["text"].split()
            for start in range(0, len(tokens) - words, words * 4):
                chunk = tokens[start:start + words]
                last = re.sub(r"[^A-Za-z']+$", "", chunk[-1])
                if not last.isalpha():
                    continue
                out.append({"text": " ".join(chunk[:-1] + [last])})
                if len(out) == n:
                    return out
    return out


def classics_cloze_file(root: str | os.PathLike | None = None) -> Path:
    """The cloze file (written once, atomically) under ``~/.cache/scape_train/smoke``."""
    base = Path(root or Path.home() / ".cache" / "scape_train" / "smoke").expanduser()
    path = base / f"lambada_classics_v{CLOZE_VERSION}.jsonl"
    if path.is_file():
        return path
    base.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in _cloze_passages()), encoding="utf-8")
    os.replace(tmp, path)
    return path
