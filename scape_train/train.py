"""The trainer: ``run(cfg)`` sets up, then ``train_step`` repeats until ``max_steps``.

Reads top to bottom:
    run()            distributed init, run dir, tokenizer, model, optimizer strategy, data,
                     checkpoint resume, W&B; the loop; the final checkpoint, plot and evaluation
    train_step()     one optimizer step: micro-batches (forward/backward), the strategy's
                     communication hooks, the non-finite check agreed by all ranks, the update
    evaluate()       the fixed validation set's mean loss
Everything the loop depends on is behind small interfaces: the optimizer strategy
(``optim/base.py``), the loader (``data/``), the checkpoint manager, the metrics sinks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from scape_train import distributed as D
from scape_train.checkpoint import CheckpointError, CheckpointManager, find_checkpoint
from scape_train.checkpoint_layout import StateParts, trainer_parts
from scape_train.config import Config, ConfigError, grad_accum_steps, validate
from scape_train.host_to_device import upload
from scape_train.metrics import (MetricsLogger, StepTimer, memory_metrics, peak_flops,
                                 plot_loss_curve, read_on_host)
from scape_train.models.attention_backend import attention_backend
from scape_train.plan.check import check_memory, resolve_checkpointing
from scape_train.preemption import StopSignal, warn_if_save_outlasts_the_agent
from scape_train.rng import get_rng_state, seed_everything, set_rng_state
from scape_train.schedule import lr_at
from scape_train.step_flags import StepFlags
from scape_train.tracking import init_wandb

log = logging.getLogger("scape_train")


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    nan_skips: int = 0            # consecutive skipped steps (nan_policy=skip)
    sent_bytes: int = 0           # bytes this rank sent by the last checkpoint (rank 0's when replicated)
    wandb_run_id: str | None = None


# cuBLAS GEMMs are deterministic only with a fixed workspace per stream (cuBLAS docs,
# "Results reproducibility"); this one is the larger of the two settings it documents.
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_algorithms() -> None:
    """``trainer.deterministic``: torch raises at the first cuBLAS GEMM when
    CUBLAS_WORKSPACE_CONFIG is unset, and sizes its cuBLAS workspaces from it once, so it is set
    here, before CUDA starts; a process that started CUDA without it is refused."""
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            raise ConfigError(
                "trainer.deterministic=true needs CUBLAS_WORKSPACE_CONFIG set before CUDA starts, "
                f"and CUDA already started in this process: export CUBLAS_WORKSPACE_CONFIG="
                f"{CUBLAS_WORKSPACE} before launching, or set trainer.deterministic=false")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)


def autocast_context(cfg: Config, device: torch.device):
    precision = cfg.trainer.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def evaluate(model, batches, autocast, info: D.DistInfo, limit: int = 0) -> float:
    """Mean token loss over the fixed validation set (all ranks' shares)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=info.device)   # read once, at the end
    count = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(batches):
            if limit and i >= limit:
                break
            x, y = x.to(info.device), y.to(info.device)
            with autocast():   # the training loss, chunked as configured: no B x T x V logits
                total += model(x, targets=y).double() * y.numel()
            count += y.numel()
    model.train(was_training)
    total, count = info.comm.reduce_scalars([total, count]).tolist()
    return total / max(count, 1.0)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.trainer
        if t.num_threads > 0:  # a negative value is reported by validate() below
            torch.set_num_threads(t.num_threads)
        if t.deterministic:    # before init_distributed, which starts CUDA
            use_deterministic_algorithms()
        self.info = D.init_distributed(t.device, t.dist_timeout_s)
        cfg, t = self._derive_config(cfg)     # +smoke overlay, init_from=hf: shapes
        from scape_train.preflight import check_preconditions

        check_preconditions(cfg, self.info)   # every cheap check, reported together; writes nothing
        validate(cfg, self.info.world_size)
        # activation_checkpointing=auto: the policy the memory plan picks for this device
        self.cfg = cfg = resolve_checkpointing(cfg, self.info)
        # the memory plan: refuse what cannot fit, before any work (kept for the start-up summary)
        self.memory_plan = check_memory(cfg, self.info)
        self.accum = grad_accum_steps(cfg, self.info.world_size)
        self.eval_tasks = None
        if cfg.eval.enabled:  # a task-name typo fails now, not after hours of training
            from scape_train.eval.tasks import prepare_tasks

            self.eval_tasks = prepare_tasks(cfg.eval)
        self.comm = self.info.comm    # every collective of this run, counted in one place
        self.run_dir = D.resolve_run_dir(cfg.run_dir, cfg.run_name, cfg.resume, self.info)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", self.info, t.keep_last)
        self._refuse_to_overwrite()
        # Fault injection for tests (docs/reliability.md), off unless set: SCAPE_FAULT_NAN_STEPS="3,4"
        # makes this process's loss NaN at those steps, as a bad batch would.
        self.fault_nan_steps = {int(s) for s in os.environ.get("SCAPE_FAULT_NAN_STEPS", "").split(",")
                                if s.strip()}
        # SCAPE_FAULT_SAVE_DELAY_S=35: every checkpoint save takes that much longer, as a large
        # model's does (preemption under torchrun, tests/test_faults_kill.py)
        self.fault_save_delay_s = float(os.environ.get("SCAPE_FAULT_SAVE_DELAY_S", "0"))
        seed_everything(t.seed)
        self._build()

    # -- set-up ----------------------------------------------------------------------------
    def _derive_config(self, cfg: Config):
        """Parts of the config derived before validation: a smoke run's sizes from the experiment
        (``+smoke=cpu``, smoke.py), the model and tokenizer of ``init_from=hf:...`` (init_from.py)."""
        from scape_train.init_from import apply_init_from
        from scape_train.smoke import apply_smoke

        self.cfg = apply_init_from(apply_smoke(cfg, self.info.world_size))
        return self.cfg, self.cfg.trainer

    def _refuse_to_overwrite(self) -> None:
        if self.cfg.resume == "none" and self.ckpt.list():
            raise CheckpointError(
                f"{self.run_dir} already holds checkpoints; continue it with resume=auto, or "
                "choose another run_dir. Nothing was changed.")

    def _build(self) -> None:
        from scape_train.data import build_tokenizer, build_train_loader, build_val_batches
        from scape_train.models import build_model
        from scape_train.models.training import compile_enabled, prepare_for_training
        from scape_train.optim import build_optimizer

        cfg, info = self.cfg, self.info
        # Rank 0 first: a tokenizer trained on the corpus is cached once, then read by the rest.
        if not info.is_main:
            D.barrier(info)
        self.tokenizer = build_tokenizer(cfg.data)
        if info.is_main:
            D.barrier(info)
        self.model = build_model(cfg.model, vocab_size=self.tokenizer.vocab_size, device=info.device)
        if cfg.init_from:  # Hugging Face weights (init_from.py); a resume below overwrites them
            from scape_train.init_from import load_init_weights

            load_init_weights(self.model, cfg.init_from)
        self.replica = None       # elastic runs: this worker's torchft replica group
        shard, shards = info.rank, info.world_size
        resume_from = self._resume_path()   # agreed by every rank; loaded below
        exchange_comm = self.comm
        if cfg.strategy.elastic.enabled:   # every step's or round's exchange across torchft
            from scape_train.elastic.replica import ReplicaGroup   # replica groups

            self.replica = ReplicaGroup(cfg.strategy.elastic, self.run_dir,
                                        self._replica_state, self._load_replica_state,
                                        device=info.device)
            exchange_comm = self.replica.comm
            shard, shards = cfg.strategy.elastic.replica, cfg.strategy.elastic.slots
        if cfg.strategy.name == "data_parallel" and self.replica is not None:
            from scape_train.optim import build_elastic_optimizer

            self.strategy = build_elastic_optimizer(cfg.optimizer, self.model, exchange_comm,
                                                    worker=cfg.strategy.elastic.replica,
                                                    total_steps=cfg.trainer.max_steps)
        elif cfg.strategy.name == "data_parallel":
            self.strategy = build_optimizer(cfg.optimizer, self.model, self.comm,
                                            total_steps=cfg.trainer.max_steps)
        else:  # DiLoCo / GASLoC / SparseLoCo: the optimizer group's optimizer takes inner steps
            from scape_train.optim.local import build_local_strategy

            # a resumed run takes its parameters from the checkpoint: no start-up broadcast
            self.strategy = build_local_strategy(cfg.strategy, cfg.optimizer, self.model,
                                                 exchange_comm, total_steps=cfg.trainer.max_steps,
                                                 broadcast_initial=resume_from is None)
        # the group this run's training exchange goes over (elastic: across the replica groups,
        # not the worker's own): its bytes are the ones logged, checkpointed and restored
        self.train_comm = self.comm if self.replica is None else self.replica.comm
        # The step's flags are read one step late where nothing waits on them: a stop policy on
        # a synchronous strategy (all ranks stop together). A skip must be decided before the
        # update, and a local-step worker must not take a non-finite drift into its round.
        self.flags = StepFlags(info.device)
        self.defer_flags = cfg.trainer.nan_policy == "stop" and self.strategy.synchronous
        self.train_loader = build_train_loader(cfg.data, self.tokenizer, cfg.trainer.micro_batch_size,
                                               shard, shards,
                                               pin_memory=info.device.type == "cuda")
        self.val_batches = build_val_batches(cfg.data, self.tokenizer, cfg.trainer.micro_batch_size,
                                             info.rank, info.world_size)
        self.state = TrainState()
        self._maybe_resume(resume_from)
        self.record_step = self.state.step   # where metrics.jsonl and W&B continue from
        if self.replica is not None:
            self._resume_worker_cursor()
        t = cfg.trainer   # checkpoint-wrap, then compile, each block; the loss's chunking
        prepare_for_training(self.model, t.activation_checkpointing,
                             compile_enabled(t.compile, info.device), t.loss_chunk_tokens)
        self.fwd_model = self.strategy.wrap_model(self.model)
        self.autocast = autocast_context(cfg, info.device)
        self.tokens_per_step = (cfg.trainer.micro_batch_size * self.accum * info.world_size
                                * cfg.data.seq_len)
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        self.peak = peak_flops(info.device) * info.world_size

    def _meta(self) -> dict[str, Any]:
        return {"model": dataclasses.asdict(self.model.cfg),
                "data": dataclasses.asdict(self.cfg.data),
                "tokenizer_fingerprint": self.tokenizer.fingerprint,
                "tokens": self.state.tokens, "wandb_run_id": self.state.wandb_run_id,
                "run_name": self.cfg.run_name}

    def _resume_path(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "none":
            return None
        if resume == "auto":
            path = self.ckpt.latest_valid_agreed()
            if path is None and self.ckpt.list():
                # Starting fresh here would prune them as new checkpoints arrive: stop instead.
                raise CheckpointError(
                    f"resume=auto: {self.ckpt.root} holds checkpoints but none passes its checksums "
                    f"({', '.join(p.name for p in self.ckpt.list())}); nothing was changed. Move "
                    "them aside to start fresh, or point resume= at a copy you trust.")
            if path is None:
                log.info("resume=auto: no checkpoint in %s, starting fresh", self.ckpt.root)
            return path
        return find_checkpoint(resume, what="resume")

    def _maybe_resume(self, path: Path | None) -> None:
        if path is None:
            return
        ckpt = self.ckpt.open(path)
        manifest = ckpt.manifest
        meta = manifest["meta"]
        ours = self._meta()
        if meta["tokenizer_fingerprint"] != ours["tokenizer_fingerprint"]:
            raise CheckpointError(f"{path} was trained with another tokenizer; use the same data."
                                  "tokenizer settings to resume. Nothing was loaded or overwritten")
        if meta.get("model") != ours["model"]:
            diff = {k: (meta["model"].get(k), v) for k, v in ours["model"].items()
                    if meta["model"].get(k) != v}
            raise CheckpointError(f"{path} was trained with another model shape "
                                  f"(checkpoint vs now: {diff}); nothing was loaded or overwritten")
        if ckpt.resharded:
            log.warning("resuming %s saved with world size %d on world size %d", path,
                        manifest["world_size"], self.info.world_size)
        # replicated: rank 0's (every rank's) part; per rank: this rank's; sharded: the owners'
        # files, read for the range this rank holds now (checkpoints without a replicated
        # file hold everything in the rank files, which this reads just the same)
        own = ckpt.per_rank
        self.model.load_state_dict(ckpt.model)
        train = self._load_strategy(ckpt.replicated, own, ckpt.shards)
        self.train_loader.load_state_dict(own["data"])
        set_rng_state(own["rng"])
        self.state = TrainState(**train)
        self.train_comm.restore_total(self.state.sent_bytes)
        log.info("resumed from %s at step %d", path, self.state.step)

    def _resume_worker_cursor(self) -> None:
        """An elastic worker's cursor, newer than any checkpoint: its data position and its own
        record at its last committed round (tokens, bytes sent, W&B run; metrics.jsonl keeps
        the rows up to that step). The step and the parameters come from the quorum, when this
        worker heals from a live peer at its first round."""
        record = self.replica.resume_cursor(self.train_loader)
        if record is None:
            return
        own = TrainState(**record)
        self.state.tokens = own.tokens
        self.state.wandb_run_id = own.wandb_run_id or self.state.wandb_run_id
        self.train_comm.restore_total(own.sent_bytes)
        self.record_step = max(self.record_step, own.step)

    def _train_record(self) -> dict:
        """The train counters as saved (a checkpoint; an elastic worker's cursor), the run's
        total bytes sent so far included."""
        self.state.sent_bytes = self.train_comm.total_sent_bytes()
        return dataclasses.asdict(self.state)

    def _load_strategy(self, replicated: dict, per_rank: dict, shards=None) -> dict:
        """The strategy from a checkpoint's pieces (or, elastic, a live peer's); returns the
        train counters."""
        self.strategy.load_checkpoint_state(
            StateParts(replicated=replicated.get("optimizer", {}),
                       per_rank=per_rank.get("optimizer", {})), shards)
        return per_rank["train"] if "train" in per_rank else replicated["train"]

    def _replica_state(self) -> dict:
        """What a healing worker takes from this one (elastic): the pieces of a checkpoint, by
        the same interface (``checkpoint_state``), less this worker's data cursor and RNG. A
        local-step strategy's state holds the parameters (theta0); other strategies' do not, and
        the model's state goes with it."""
        parts = trainer_parts(self.strategy.checkpoint_state(), data={}, rng={},
                              train=dataclasses.asdict(self.state),
                              synchronous=self.strategy.synchronous)
        state = {"replicated": parts.replicated, "per_rank": parts.per_rank}
        if not self.strategy.state_holds_params:
            state["model"] = self.model.state_dict()
        return state

    def _load_replica_state(self, state: dict) -> None:
        """Heal from a live peer: its committed point and step (the strategy keeps this worker's
        own uncommitted drift); this worker keeps its data shard and position, RNG and tokens."""
        if "model" in state:
            self.model.load_state_dict(state["model"])
        train = self._load_strategy(state["replicated"], state["per_rank"])
        self.state.step, self.state.nan_skips = int(train["step"]), 0

    def save_checkpoint(self) -> Path:
        # Never write a checkpoint that cannot be resumed from: non-finite weights can appear one
        # step before the loss shows them (the update that overflows comes after the forward).
        bad = torch.stack([~torch.isfinite(p).all() for p in self.model.parameters()]).any()
        if self.comm.reduce_scalars([bad]).item() > 0:
            raise NonFiniteLossError(
                f"non-finite parameters after step {self.state.step}: not checkpointed. The last "
                f"good checkpoint is {self.ckpt.latest_valid() or 'none'}; resume from it with "
                "resume=auto, e.g. with a lower optimizer.lr or optimizer.clip_grad > 0.")
        time.sleep(self.fault_save_delay_s)
        # Each piece once, by the rank that holds it: the strategy says which part of its state
        # is replicated, owner-sharded or per rank; tensors go to disk from where they live.
        parts = trainer_parts(self.strategy.checkpoint_state(), data=self.train_loader.state_dict(),
                              rng=get_rng_state(), train=self._train_record(),
                              synchronous=self.strategy.synchronous)
        model_state = self.model.state_dict() if self.info.is_main else None
        # Named by the step all ranks agree on (local-step strategies: rounds x H), since the
        # local step can differ between ranks.
        agreed = self.strategy.progress(self.state.step)
        return self.ckpt.save(self.state.step if agreed is None else agreed, model_state,
                              parts.per_rank, self._meta(),
                              replicated=parts.replicated if self.info.is_main else None,
                              sharded=parts.sharded)

    # -- one step --------------------------------------------------------------------------
    def train_step(self, timer: StepTimer, stop: StopSignal) -> dict[str, float]:
        cfg, info, strategy = self.cfg, self.info, self.strategy
        if self.replica is not None and strategy.progress(self.state.step) is not None:
            # a round starts: its quorum (a worker behind the others heals here, step included)
            for line in self.replica.begin_round():
                log.warning("%s", line)
        step = self.state.step + 1
        lr = lr_at(step, kind=cfg.trainer.lr_schedule, peak=cfg.optimizer.lr,
                   min_lr=cfg.optimizer.min_lr, warmup=cfg.trainer.warmup_steps,
                   total=cfg.trainer.max_steps, decay_steps=cfg.trainer.decay_steps)
        strategy.before_forward(step)
        loss_sum = torch.zeros((), device=info.device)  # summed on the device, not read per micro
        for micro in range(self.accum):
            with timer.phase("data"):
                x, y = next(self.train_loader)
                x, y = upload(x, info.device), upload(y, info.device)   # through pinned memory
            with timer.phase("fwd_bwd"):
                with strategy.sync_context(self.fwd_model, micro == self.accum - 1), self.autocast():
                    # the model computes its loss: it masks the padded vocab in place
                    loss = self.fwd_model(x, targets=y) / self.accum
                    if step in self.fault_nan_steps:
                        loss = loss * float("nan")
                loss.backward()
            loss_sum += loss.detach().float()
            del loss
        with timer.phase("optimizer"):
            strategy.after_backward()
            # One tiny collective of device scalars agrees on the loss, a non-finite loss and a
            # stop request. Local-step strategies make no per-step collective: each worker
            # judges its own.
            flags = [loss_sum, (~torch.isfinite(loss_sum)).float(), float(stop.requested)]
            if strategy.synchronous:
                agreed = self.comm.reduce_scalars(flags)
                agreed[0] /= info.world_size
            else:
                agreed = self.comm.scalars(flags)
            if not self.defer_flags:
                # the skip decision needs them before the update: the step's one host sync
                loss_mean, bad, stop_any = agreed.tolist()
                stop.agreed = stop_any > 0
                if bad > 0:
                    strategy.zero_grad()
                    return self._non_finite(step, loss_mean)
            else:
                # nan_policy=stop on a synchronous strategy: the previous step's flags are
                # judged now (a non-finite loss stops the run before anything is saved), this
                # step's next time, so the host never waits for the device within a step
                self.settle_flags(stop)
                self.flags.post(step, agreed)
            metrics = strategy.step(lr)
            strategy.zero_grad()
        self.state.nan_skips = 0
        self.state.step = step
        self.state.tokens += self.tokens_per_step
        return {"loss": agreed[0], "lr": lr, **metrics}

    def settle_flags(self, stop: StopSignal) -> None:
        """Judge the posted step's flags (if any): stop on a non-finite loss, agree on a stop
        request. Every rank takes the same all-reduced flags at the same step."""
        taken = self.flags.take()
        if taken is None:
            return
        step, (loss_mean, bad, stop_any) = taken
        stop.agreed = stop.agreed or stop_any > 0
        if bad > 0:
            self._non_finite(step, loss_mean)

    def _non_finite(self, step: int, loss: float) -> dict[str, float]:
        policy, t = self.cfg.trainer.nan_policy, self.cfg.trainer
        self.state.nan_skips += 1
        if policy == "stop" or self.state.nan_skips > t.max_nan_skips:
            last = self.ckpt.latest_valid()
            raise NonFiniteLossError(
                f"non-finite loss ({loss}) at step {step}"
                f"{f' ({self.state.nan_skips} in a row)' if policy == 'skip' else ''}. "
                f"The last good checkpoint is {last or 'none (none was saved yet)'}; resume from it "
                "with resume=auto, e.g. with a lower optimizer.lr, or set trainer.nan_policy=skip.")
        log.warning("non-finite loss at step %d: step skipped (%d in a row)", step, self.state.nan_skips)
        self.state.step = step  # the step is consumed (its data too), the weights unchanged
        return {"loss": loss, "skipped_nonfinite": 1.0}

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, info, t = self.cfg, self.info, self.cfg.trainer
        wandb_run = None
        if info.is_main:
            resolved = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            # The tokenizer travels with the run, so evaluation and export need nothing else.
            self.tokenizer.save_pretrained(self.run_dir / "tokenizer")
            wandb_run, self.state.wandb_run_id = init_wandb(
                cfg.logging.wandb, cfg.run_name, self.run_dir, resolved, self.state.wandb_run_id,
                step=self.record_step)
            from scape_train.summary import report_startup

            report_startup(self, wandb_run)   # printed once; W&B config/summary when active
        self.state.wandb_run_id = D.broadcast_object(self.state.wandb_run_id, info)
        logger = MetricsLogger(self.run_dir, info.is_main, t.max_steps,
                               cfg.logging.progress_bar, wandb_run, self.record_step)
        timer = StepTimer(info.device)
        summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        window_start, window_steps = time.perf_counter(), 0
        try:
            # the SDPA kernel order in force where the blocks run (and compile: inductor picks
            # the kernel when it traces)
            with StopSignal() as stop, attention_backend(t.attention_backend):
                done = self.strategy.progress(self.state.step) or 0
                stop_at = done + t.stop_after if t.stop_after else None
                while done < t.max_steps:
                    metrics = self.train_step(timer, stop)
                    step = self.state.step
                    window_steps += 1
                    # ``agreed`` is the step count all ranks share (None between a local-step
                    # strategy's sync points): validation, checkpoints and the end happen there.
                    agreed = self.strategy.progress(step)
                    last = evaluating = saving = stopping = False
                    if agreed is not None:
                        last = agreed >= t.max_steps
                        evaluating = _crossed(done, agreed, t.eval_every) or last
                        saving = _crossed(done, agreed, t.checkpoint_every) or last
                        stopping = stop_at is not None and agreed >= stop_at and not last
                    logging_now = step % t.log_every == 0 or last
                    if evaluating or saving or stopping or stop.agreed or logging_now:
                        # this step's flags, read now: a non-finite loss stops the run before
                        # anything is logged or saved, and a stop request is agreed in time
                        self.settle_flags(stop)
                    if logging_now:
                        # the only place the step's device metrics are read (NCCL: no per-step
                        # host syncs)
                        metrics = read_on_host(metrics)
                        elapsed = time.perf_counter() - window_start
                        tok_s = self.tokens_per_step * window_steps / elapsed
                        metrics.update({f"time/{k}_s": v / window_steps for k, v in timer.pop().items()})
                        # per-step means over the logging window
                        metrics.update({k: v / window_steps
                                        for k, v in self.train_comm.pop_stats().items()})
                        metrics["comm/total_sent_bytes"] = self.train_comm.total_sent_bytes()
                        if self.replica is not None:
                            metrics.update(self.replica.metrics())
                        metrics.update(self.train_loader.metrics())
                        metrics.update(memory_metrics(info.device))
                        metrics.update({"tokens_per_s": tok_s, "tokens": self.state.tokens,
                                        "step_time_s": elapsed / window_steps,
                                        "mfu": self.flops_per_token * tok_s / self.peak})
                        logger.log(step, metrics)
                        window_start, window_steps = time.perf_counter(), 0
                    if agreed is None:
                        continue
                    if self.replica is not None:
                        self.replica.end_round(self.train_loader.state_dict(),
                                               self._train_record())
                    if stopping:
                        stop.agreed = True  # same path as a preemption: checkpoint, exit
                    if evaluating:
                        val = evaluate(self.fwd_model, self.val_batches, self.autocast, info, t.eval_batches)
                        logger.log(step, {"val_loss": val})
                        summary["val_loss"] = val
                        window_start = time.perf_counter()  # validation time is not training time
                    if saving or stop.agreed:
                        save_start = time.perf_counter()
                        summary["checkpoint"] = str(self.save_checkpoint())
                        window_start = time.perf_counter()
                        warn_if_save_outlasts_the_agent(window_start - save_start)
                    done = agreed
                    logger.advance(agreed)
                    if stop.agreed:
                        log.warning("stopped after step %d (signal or trainer.stop_after); "
                                    "checkpoint %s", step, summary.get("checkpoint"))
                        summary["stopped_early"] = True
                        break
        finally:
            logger.close()
            self.train_loader.close()
            self.strategy.close()
            if self.replica is not None:
                summary["elastic"] = self.replica.summary()
                summary.update(self.replica.metrics())   # the counts, for the W&B summary
                self.replica.close()
        summary["step"] = self.state.step
        if info.is_main and (self.run_dir / "metrics.jsonl").exists():
            summary["loss_curve"] = str(plot_loss_curve(self.run_dir / "metrics.jsonl",
                                                        self.run_dir / "loss_curve.png"))
        if cfg.eval.enabled and not summary.get("stopped_early"):
            from scape_train.eval.runner import evaluate_downstream

            summary["downstream"] = evaluate_downstream(
                self.model, self.tokenizer, cfg.eval, self.run_dir, info, wandb_run,
                setup=self.eval_tasks)
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            wandb_run.finish()
        return summary


def _crossed(before: int, after: int, every: int) -> bool:
    """Did the step count pass a multiple of ``every`` in (before, after]?"""
    return every > 0 and after // every > before // every


def run(cfg: Config) -> dict[str, Any]:
    """Train as configured; returns a summary (run_dir, step, val_loss, checkpoint, loss_curve)."""
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        D.shutdown(trainer.info)
    if trainer.info.is_main:
        print(f"\nrun directory: {summary['run_dir']}")
        for key in ("checkpoint", "loss_curve"):
            if key in summary:
                print(f"{key.replace('_', ' ')}: {summary[key]}")
        print(f"metrics: {Path(summary['run_dir']) / 'metrics.jsonl'}")
        if "val_loss" in summary:
            print(f"final validation loss: {summary['val_loss']:.4f} at step {summary['step']}")
        if "elastic" in summary:
            e = summary["elastic"]
            print(f"elastic: replica {e['slot']}, {e['committed_rounds']} committed rounds, "
                  f"quorum at the end {e['quorum']}; faults survived: {len(e['left'])} left "
                  f"(round, replica) {e['left']}, {len(e['joined'])} joined {e['joined']}, "
                  f"{len(e['failed_rounds'])} rounds failed {e['failed_rounds']}; healed from a "
                  f"peer at rounds {e['healed_at']}")
        _print_sample(trainer, summary)
    return summary


def _print_sample(trainer: Trainer, summary: dict[str, Any]) -> None:
    """Rank 0, at the end: a short sample from the trained model (trainer.sample_tokens=0: none)."""
    t = trainer.cfg.trainer
    if t.sample_tokens <= 0 or summary.get("stopped_early"):
        return
    from scape_train.generate import training_sample

    try:
        text = training_sample(trainer.model, trainer.tokenizer, t.sample_tokens, t.sample_prompt,
                               seed=t.seed, autocast=trainer.autocast)
    except Exception as exc:  # noqa: BLE001 - the run is done and saved; a sample never fails it
        log.warning("no end-of-run sample: %s", exc)
        return
    summary["sample"] = text
    print(f"sample ({t.sample_tokens} tokens, temperature 0.8, top-k 50):\n{text}")
