"""The root typed config, composed by Hydra from the groups in ``configs/``.

Each component owns its dataclass (``models/config.py``, ``data/config.py``, ``optim/config.py``,
``eval/config.py``); this file adds the trainer's, logging's and the root, registers the schema
with Hydra's ConfigStore, and validates cross-component values before any work starts. Struct mode
makes an unknown key an error at composition time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from scape_train.data.config import DataConfig
from scape_train.eval.config import EvalConfig
from scape_train.models.config import ModelConfig
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.local.config import StrategyConfig
from scape_train.smoke import SmokeConfig


@dataclass
class TrainerConfig:
    max_steps: int = 400
    stop_after: int = 0               # end this invocation after N more steps (checkpointed), for
                                      # time-sliced jobs; the schedule still runs to max_steps
    micro_batch_size: int = 8         # sequences per rank per forward
    global_batch_size: int = 0        # sequences per optimizer step; 0 = micro * world (no accum)
    lr_schedule: str = "cosine"       # cosine | wsd | constant
    warmup_steps: int = 40
    decay_steps: int = 0              # wsd: length of the final decay; 0 = 20% of max_steps
    log_every: int = 10
    eval_every: int = 100             # validation loss every N steps (0 = only at the end)
    eval_batches: int = 0             # 0 = the whole fixed validation set
    checkpoint_every: int = 200       # 0 = only at the end
    keep_last: int = 3
    precision: str = "auto"           # auto (bf16 where supported, GPU) | fp32 | bf16
    compile: bool = False
    activation_checkpointing: bool = False
    seed: int = 1337
    deterministic: bool = False
    device: str = "auto"              # auto | cpu | cuda
    nan_policy: str = "stop"          # stop | skip
    max_nan_skips: int = 10           # with skip: stop after this many skipped steps in a row
    dist_timeout_s: int = 600         # a dead rank makes the others fail after this long
    num_threads: int = 0              # torch CPU threads per rank; 0 = torch's default
    sample_tokens: int = 32           # rank 0 prints a sample of N tokens at the end; 0 = none
    sample_prompt: str = ""           # the sample's prompt ("" = the start of a new document)


@dataclass
class WandbConfig:
    mode: str = "offline"             # online | offline | disabled
    project: str = "scape_train"
    entity: Optional[str] = None
    name: Optional[str] = None        # default: run_name
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    run_name: str = "default"
    run_dir: Optional[str] = None     # None: outputs/<run_name>/<timestamp> (agreed by all ranks)
    resume: str = "none"              # none | auto | <checkpoint dir>
    # hf:<dir|hub id>: start from Hugging Face weights (GPT-2 / Llama); the model shape and the
    # tokenizer come with them (scape_train/init_from.py). Ignored when resuming a checkpoint.
    init_from: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)   # +smoke=cpu (scape_train/smoke.py)


def register_configs() -> None:
    """Register the schemas so YAML groups are merged onto typed, struct-mode nodes."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="optimizer", name="schema", node=OptimizerConfig)
    cs.store(group="strategy", name="schema", node=StrategyConfig)
    cs.store(group="trainer", name="schema", node=TrainerConfig)
    cs.store(group="logging", name="schema", node=LoggingConfig)
    cs.store(group="eval", name="schema", node=EvalConfig)


class ConfigError(ValueError):
    """A config value or combination that cannot work; raised before any work starts."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def to_object(cfg: DictConfig | Config) -> Config:
    """A typed ``Config`` from Hydra's node (or an already-typed one)."""
    if isinstance(cfg, Config):
        return cfg
    return OmegaConf.to_object(cfg)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Cross-component checks with messages that say what to change."""
    t, m, d, o = cfg.trainer, cfg.model, cfg.data, cfg.optimizer
    _check(t.max_steps > 0, f"trainer.max_steps must be > 0, got {t.max_steps}")
    _check(t.micro_batch_size > 0, f"trainer.micro_batch_size must be > 0, got {t.micro_batch_size}")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size:
        _check(t.global_batch_size % per_step == 0,
               f"trainer.global_batch_size={t.global_batch_size} must be a multiple of "
               f"micro_batch_size ({t.micro_batch_size}) x world size ({world_size}) = {per_step}")
    _check(0 <= t.warmup_steps <= t.max_steps,
           f"trainer.warmup_steps={t.warmup_steps} must be in [0, max_steps={t.max_steps}]")
    _check(t.lr_schedule in ("cosine", "wsd", "constant"),
           f"trainer.lr_schedule must be cosine|wsd|constant, got {t.lr_schedule!r}")
    _check(t.precision in ("auto", "fp32", "bf16"),
           f"trainer.precision must be auto|fp32|bf16, got {t.precision!r}")
    _check(t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto|cpu|cuda, got {t.device!r}")
    _check(t.nan_policy in ("stop", "skip"), f"trainer.nan_policy must be stop|skip, got {t.nan_policy!r}")
    _check(t.log_every > 0, "trainer.log_every must be > 0")
    _check(t.stop_after >= 0, "trainer.stop_after must be >= 0 (0 = run to max_steps)")
    _check(t.eval_every >= 0 and t.checkpoint_every >= 0,
           "trainer.eval_every and trainer.checkpoint_every must be >= 0 (0 = only at the end)")
    _check(t.keep_last >= 1, f"trainer.keep_last must be >= 1, got {t.keep_last}")
    _check(t.dist_timeout_s > 0, "trainer.dist_timeout_s must be > 0")
    _check(d.seq_len > 0, f"data.seq_len must be > 0, got {d.seq_len}")
    _check(d.seq_len <= m.max_seq_len,
           f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
           "raise model.max_seq_len or lower data.seq_len")
    _check(o.lr > 0 and 0 <= o.min_lr <= o.lr,
           f"optimizer.lr must be > 0 and 0 <= optimizer.min_lr <= lr (got lr={o.lr}, min_lr={o.min_lr})")
    _check(cfg.logging.wandb.mode in ("online", "offline", "disabled"),
           f"logging.wandb.mode must be online|offline|disabled, got {cfg.logging.wandb.mode!r}")
    _check(cfg.resume == "none" or cfg.resume == "auto" or len(cfg.resume) > 0,
           "resume must be none, auto or a checkpoint directory")
    _check(t.max_nan_skips >= 0, f"trainer.max_nan_skips must be >= 0, got {t.max_nan_skips}")
    _check(t.num_threads >= 0, f"trainer.num_threads must be >= 0 (0 = torch's default), got {t.num_threads}")
    _check(t.sample_tokens >= 0, f"trainer.sample_tokens must be >= 0 (0 = no sample), got {t.sample_tokens}")
    _check(cfg.init_from is None or cfg.init_from.startswith("hf:"),
           f"init_from must be hf:<dir or hub id>, got {cfg.init_from!r}")
    _check(t.eval_batches >= 0, f"trainer.eval_batches must be >= 0 (0 = all), got {t.eval_batches}")
    _check(0 <= t.decay_steps <= t.max_steps,
           f"trainer.decay_steps={t.decay_steps} must be in [0, max_steps={t.max_steps}] (0 = 20%)")
    _check(d.val_tokens > 0, f"data.val_tokens must be > 0, got {d.val_tokens}")
    _check(d.val_split is not None or d.val_docs > 0,
           f"data.val_docs must be > 0 when data.val_split=null (documents held out), got {d.val_docs}")
    _check(d.shuffle_buffer >= 0, f"data.shuffle_buffer must be >= 0 (0 = stream order), got {d.shuffle_buffer}")
    _check(d.num_workers >= 0 and d.prefetch >= 1,
           f"data.num_workers must be >= 0 and data.prefetch >= 1, got {d.num_workers}, {d.prefetch}")
    _check(bool(d.text_field), "data.text_field must name the records' text field, e.g. text")
    # Each component's own checks, now rather than after minutes of tokenizer training.
    from scape_train.models.build import resolve_config
    from scape_train.optim import validate as validate_optimizer

    resolve_config(m, vocab_size=m.vocab_size or 1)
    validate_optimizer(o)
    if cfg.strategy.name != "data_parallel":
        from scape_train.optim.local import validate as validate_strategy

        validate_strategy(cfg.strategy, o, world_size)


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    per_step = cfg.trainer.micro_batch_size * world_size
    return max(1, cfg.trainer.global_batch_size // per_step) if cfg.trainer.global_batch_size else 1
