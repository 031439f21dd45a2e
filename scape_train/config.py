"""The root typed config, composed by Hydra from the groups in ``configs/``.

Each component owns its dataclass (``models/config.py``, ``data/config.py``, ``optim/config.py``,
``eval/config.py``); this file adds the trainer's, logging's and the root, registers the schema
with Hydra's ConfigStore, and validates cross-component values before any work starts. Struct mode
makes an unknown key an error at composition time; a key appended with ``+key=...`` (which struct
mode lets through) is refused by ``to_object`` and, on the command line, by ``override_key_problems``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from scape_train.data.config import DataConfig
from scape_train.eval.config import EvalConfig
from scape_train.models.config import ModelConfig
from scape_train.optim.config import OptimizerConfig
from scape_train.optim.local.config import StrategyConfig
from scape_train.plan.config import PlanConfig
from scape_train.smoke import SmokeConfig


@dataclass
class TrainerConfig:
    max_steps: int = 400              # optimizer steps of the whole run (the lr schedule's length)
    stop_after: int = 0               # end this invocation after N more steps (checkpointed), for
                                      # time-sliced jobs; the schedule still runs to max_steps
    micro_batch_size: int = 8         # sequences per rank per forward
    global_batch_size: int = 0        # sequences per optimizer step; 0 = micro * world (no accum)
    lr_schedule: str = "cosine"       # cosine | wsd | constant
    warmup_steps: int = 40            # linear lr warmup, in [0, max_steps]
    decay_steps: int = 0              # wsd: length of the final decay; 0 = 20% of max_steps
    log_every: int = 10               # metrics.jsonl / W&B / progress bar every N steps
    eval_every: int = 100             # validation loss every N steps (0 = only at the end)
    eval_batches: int = 0             # 0 = the whole fixed validation set
    checkpoint_every: int = 200       # 0 = only at the end
    keep_last: int = 3                # checkpoints kept (older ones are pruned)
    precision: str = "auto"           # auto (bf16 where supported, GPU) | fp32 | bf16
    compile: str = "auto"             # auto (CUDA only) | true | false: compile each block, the loss
    # none | selective | full | full_every_N (every N-th block full, the others selective) |
    # auto (the memory plan picks the least recompute that fits); true/false = full/none.
    # Trade-offs: scape_train/models/checkpointing.py
    activation_checkpointing: str = "none"
    attention_backend: str = "auto"   # auto | cudnn | flash | efficient | math: the SDPA kernel
                                      # tried first (models/attention_backend.py)
    loss_chunk_tokens: int = 8192     # micro-batches of more tokens get the loss chunk by chunk,
                                      # never all logits at once (models/loss.py); 0 = never
    seed: int = 1337                  # model init and dropout (data order: data.seed)
    deterministic: bool = False       # torch.use_deterministic_algorithms (slower)
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
    project: str = "scape_train"      # W&B project
    entity: Optional[str] = None      # W&B team or user; None = your default
    name: Optional[str] = None        # default: run_name
    group: Optional[str] = None       # W&B run group (e.g. one per model size)
    tags: List[str] = field(default_factory=list)  # W&B tags


@dataclass
class LoggingConfig:
    progress_bar: bool = True         # tqdm bar on rank 0 (false: a log line per log step)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    run_name: str = "default"         # names outputs/<run_name>/<timestamp> and the W&B run
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
    plan: PlanConfig = field(default_factory=PlanConfig)   # the start-up memory plan (plan/)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)   # +smoke=cpu (scape_train/smoke.py)


def register_configs() -> None:
    """Register the schemas so YAML groups are merged onto typed, struct-mode nodes."""
    cs = ConfigStore.instance()
    # The root schema types every group's node (``model: ModelConfig`` ...), so a group file is
    # merged onto its dataclass without a per-group "schema" entry (which would show up as a
    # fake option in ``--help`` and in ``model=<TAB>``).
    cs.store(name="base_config", node=Config)
    from scape_train.cli_help import register_help_resolver

    register_help_resolver(Config)


class ConfigError(ValueError):
    """A config value or combination that cannot work; raised before any work starts."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def to_object(cfg: DictConfig | Config) -> Config:
    """A typed ``Config`` from Hydra's node (or an already-typed one).

    Keys appended with ``+key=value`` (or ``++``) bypass struct mode at composition; one that no
    schema has is refused here, like a typo, naming the closest valid key."""
    if isinstance(cfg, Config):
        return cfg
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError("; ".join(unknown))
    return OmegaConf.to_object(cfg)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """A message per key of ``node`` (recursively) that its dataclass schema does not have."""
    import dataclasses
    import difflib

    out = []
    schema = OmegaConf.get_type(node)
    fields = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        full = f"{prefix}{key}"
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            hint = (f"did you mean {prefix}{close[0]}?" if close
                    else f"the keys of {prefix.rstrip('.') or 'the root'} are {', '.join(fields)}")
            out.append(f"unknown key {full!r}: {schema.__name__} has no field {str(key)!r} (a key "
                       f"appended with +{full}=... must still be one the schema has); {hint}")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none() \
                and not child._is_interpolation():
            out.extend(unknown_keys(child, f"{full}."))
    return out


_CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def override_key_problems(args: list[str]) -> list[str]:
    """A message per command-line override whose key no schema has (``a.b=1``, ``+a.b=1``,
    ``++a.b=1``), naming the closest valid key; checked before Hydra composes anything."""
    import dataclasses
    import difflib
    import typing

    from scape_train.cli_help import dataclass_of

    out = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if "@" in key or key.startswith(("hydra.", "hydra/", "~")) or key == "hydra":
            continue   # Hydra's own keys and deletions are Hydra's to check
        if "." not in key and (_CONFIG_DIR / key).is_dir():
            continue   # a group choice (model=..., +experiment=...): Hydra checks the option
        schema, done = Config, []
        for part in key.split("."):
            fields = [f.name for f in dataclasses.fields(schema)]
            if part not in fields:
                where = ".".join(done)
                close = difflib.get_close_matches(part, fields, n=1, cutoff=0.5)
                hint = (f"did you mean {'.'.join(done + [close[0]])}?" if close
                        else f"the keys of {where or 'the root'} are {', '.join(fields)}")
                out.append(f"unknown key {key!r} in {arg!r}: {schema.__name__} has no field "
                           f"{part!r}; {hint}")
                break
            done.append(part)
            schema = dataclass_of(typing.get_type_hints(schema).get(part))
            if schema is None:     # a leaf, or a free-form dict (eval.local_data.TASK)
                break
    return out


def validate(cfg: Config, world_size: int = 1) -> None:
    """Cross-component checks with messages that say what to change; every problem at once."""
    problems = config_problems(cfg, world_size)
    if problems:
        raise ConfigError(format_problems(problems))


def format_problems(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return (f"{len(problems)} problems, all found before any work started:\n"
            + "\n".join(f"  - {p}" for p in problems))


def config_problems(cfg: Config, world_size: int = 1) -> list[str]:
    """Every cross-component problem of ``cfg`` (no I/O), each a message that says what to change."""
    problems: list[str] = []

    def _check(cond: bool, msg: str) -> None:  # collects instead of raising on the first
        if not cond:
            problems.append(msg)

    from scape_train.models.attention_backend import parse_attention_backend
    from scape_train.models.checkpointing import parse_policy
    from scape_train.models.training import parse_compile

    t, m, d, o = cfg.trainer, cfg.model, cfg.data, cfg.optimizer
    _check(t.max_steps > 0, f"trainer.max_steps must be > 0, got {t.max_steps}")
    _check(t.micro_batch_size > 0, f"trainer.micro_batch_size must be > 0, got {t.micro_batch_size}")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size and per_step > 0:
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
    for parse, value in ((parse_policy, t.activation_checkpointing), (parse_compile, t.compile),
                         (parse_attention_backend, t.attention_backend)):
        try:
            parse(value)
        except ValueError as exc:
            problems.append(str(exc))
    _check(t.loss_chunk_tokens >= 0,
           f"trainer.loss_chunk_tokens must be >= 0 (0 = the full logits), got {t.loss_chunk_tokens}")
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
    _check(o.name not in ("scape", "topk_adamw") or o.density_schedule == "constant"
           or o.density_warmup_steps <= t.max_steps,
           f"optimizer.density_warmup_steps={o.density_warmup_steps} is longer than the run "
           f"(trainer.max_steps={t.max_steps}): the density would never reach optimizer.density="
           f"{o.density}; lower optimizer.density_warmup_steps (the paper warms up over 10% of the "
           "steps) or raise trainer.max_steps")
    _check(o.name not in ("scape", "topk_adamw")
           or o.density_start_step + o.density_cooldown_steps <= t.max_steps,
           f"optimizer.density_start_step={o.density_start_step} plus "
           f"optimizer.density_cooldown_steps={o.density_cooldown_steps} is longer than the run "
           f"(trainer.max_steps={t.max_steps}): no step would run at optimizer.density="
           f"{o.density}; shorten them or raise trainer.max_steps")
    # Each component's own checks, now rather than after minutes of tokenizer training.
    from scape_train.models.build import resolve_config
    from scape_train.optim import validate as validate_optimizer

    components = [lambda: resolve_config(m, vocab_size=m.vocab_size or 1), lambda: validate_optimizer(o)]
    if cfg.strategy.name != "data_parallel":
        from scape_train.optim.local import validate as validate_strategy

        components.append(lambda: validate_strategy(cfg.strategy, o, world_size))
    elif cfg.strategy.elastic.enabled:
        from scape_train.optim import validate_elastic_optimizer
        from scape_train.optim.local import validate_elastic

        components.append(lambda: validate_elastic_optimizer(o))
        _check(t.nan_policy == "stop",
               "trainer.nan_policy=skip with elastic data parallelism: a worker that skipped "
               "would miss its step's all-reduce and fail the step for everyone; keep the "
               "default stop (that worker then stops and the others go on without it)")
        components.append(lambda: validate_elastic(cfg.strategy, world_size))
    for component in components:
        try:
            component()
        except (ValueError, ArithmeticError, TypeError) as exc:
            problems.append(str(exc))
    return problems


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    per_step = cfg.trainer.micro_batch_size * world_size
    return max(1, cfg.trainer.global_batch_size // per_step) if cfg.trainer.global_batch_size else 1
