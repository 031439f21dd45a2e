"""The checks of ``scripts/gpu_check.py``, most valuable first, each with its time limit on one
H200 (the runner runs each in a process of its own and kills it past the limit). Each takes a
:class:`Ctx` and returns its figures as a JSON-able dict (``"ok": False`` or an exception: failed).
``ctx.smoke``: toy sizes on the CPU, Triton interpreted where ``TRITON_INTERPRET=1``. Nothing is
written outside ``ctx.tmp``.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# this script's folder is on sys.path (gpu_check.py runs from it); CHECKS: read by gpu_check.py
from gpu_measure import (CHECKS, OPTIONAL, REPO, Ctx, check, first_cuda_sync,  # noqa: F401
                         top_kernels)


def _llama500m(ctx: Ctx, n_layers: int = 16):
    """The paper's Llama-500M at its 32k vocabulary (toy sizes in smoke mode)."""
    import torch

    from scape_train.models import build_model
    from scape_train.models.config import ModelConfig

    if ctx.smoke:
        cfg = ModelConfig(name="smoke", arch="llama", n_layers=2, d_model=64, n_heads=4,
                          n_kv_heads=2, ffn_dim=128, max_seq_len=64, vocab_size=256)
    else:
        cfg = ModelConfig(name="llama500m", arch="llama", n_layers=n_layers, d_model=1536,
                          n_heads=16, n_kv_heads=8, ffn_dim=4096, max_seq_len=4096,
                          vocab_size=32000, vocab_pad_multiple=1, rope_theta=100000.0,
                          tie_embeddings=False)
    torch.manual_seed(0)
    return build_model(cfg, vocab_size=cfg.vocab_size, device=ctx.device)


def _gradient_filler(ctx: Ctx, params, current: dict):
    """``fill(i)``: seeded gradients into the current strategy's gradient buffer."""
    import torch

    from scape_train.optim.grad_buffer import write_grads

    def fill(i):
        g = torch.Generator(device=ctx.device).manual_seed(i)
        # one gradient at a time (a generator): the peak memory is the strategy's, not the filler's
        write_grads(params, (torch.randn(p.shape, device=ctx.device, generator=g).mul_(1e-2)
                             for p in params), getattr(current.get("s"), "grad_buffer", None))
    return fill


def _captured_median_s(ctx: Ctx, step, fill) -> float:
    """Device time of one steady step replayed as a captured CUDA graph (median of the timed
    steps): the same kernels without their host issue. The replays repeat the captured step's
    scalars (lr, bias corrections), so this measures what capture would save, not training."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # a steady step on the capturing stream first
        fill(97)
        step()
    torch.cuda.current_stream().wait_stream(side)
    fill(96)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return statistics.median(ctx.step_times(graph.replay, TIMED_STEPS))


# ------------------------------------------------------------------------------------------ checks

WARMUP_STEPS, TIMED_STEPS = 5, 10


@check("scape_vs_adams_step", 55, "SCAPE-99 step vs AdamS step, Llama-500M shapes, one GPU: time "
       "(5 warm-up steps, then the median of 10), the first CUDA sync (error mode, named), "
       "launches, the top 10 kernels (profiler), peak memory")
def check_scape_step(ctx: Ctx) -> dict:
    import torch

    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig
    from scape_train.profiling import DeviceOpCounter

    model = _llama500m(ctx)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    current: dict = {}
    fill = _gradient_filler(ctx, params, current)
    triton = "on" if ctx.cuda or os.environ.get("TRITON_INTERPRET") == "1" else "off"
    out = {"params": n}
    for name, kw in (("scape99", dict(name="scape", density=0.01, use_triton=triton)),
                     ("adams", dict(name="adams"))):
        if ctx.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        strategy = current["s"] = build_optimizer(OptimizerConfig(clip_grad=1.0, **kw), model)
        step = functools.partial(strategy.step, 1e-4)
        # the first steps build SCAPE's first mask and compile the Triton kernels
        res = {"warmup_s": ctx.step_times(step, WARMUP_STEPS, before=fill)}
        times = ctx.step_times(step, 3 if ctx.smoke else TIMED_STEPS, before=fill)
        res.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times))
        fill(98)
        with DeviceOpCounter() as ops:
            step()
        res.update(launches_per_step=ops.launches, counted_host_syncs_per_step=ops.host_syncs,
                   bytes_per_param=ops.bytes_moved / n)
        fill(97)
        res["kernels"] = top_kernels(ctx, step)
        if ctx.cuda:
            try:
                graph = _captured_median_s(ctx, step, fill)
                res.update(graph_median_s=graph, graph_over_eager=graph / res["median_s"])
            except Exception as exc:      # a step that cannot be captured: say why
                res["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if ctx.cuda:
            res["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        fill(99)
        res["cuda_sync"] = first_cuda_sync(step)        # last: a sync stops the step midway
        strategy.close()
        out[name] = res
        del strategy, step
        current.clear()
        for p in params:            # the flat buffer's views would keep it alive
            p.grad = None
    out["scape99_over_adams"] = out["scape99"]["median_s"] / out["adams"]["median_s"]
    return out


TRAIN_STEPS = 20

# (name, overrides on the preset): the presets as shipped (compile auto: on; checkpointing auto:
# the plan's pick), then SCAPE-99 with selective checkpointing, the other setting worth having
TRAIN_RUNS = (("scape99", []), ("adams", ["optimizer=adams"]),
              ("scape99_selective", ["trainer.activation_checkpointing=selective"]))
RUN_COMMON = ["trainer.warmup_steps=2", "trainer.log_every=5", "trainer.eval_every=0",
              "trainer.checkpoint_every=0", "trainer.global_batch_size=0", "trainer.sample_tokens=0",
              "eval.enabled=false", "logging.wandb.mode=disabled", "logging.progress_bar=false",
              "plan.check=off", "data=classics", "data.num_workers=3"]  # tokenizing off the trainer


def _steps(ctx: Ctx) -> int:
    return 4 if ctx.smoke else TRAIN_STEPS


def _with_toy(overrides: list[str], toy: list[str]) -> list[str]:
    keys = {o.split("=")[0] for o in toy}
    return [o for o in overrides if o.split("=")[0] not in keys] + toy


def _train_overrides(ctx: Ctx, name: str, extra: list[str]) -> list[str]:
    """llama500m_s99 as shipped (micro-batch 16, no accumulation) at the paper's 32k vocabulary
    and sequence 4096, on the shipped text; SCAPE's density warm-up shortened to a quarter."""
    steps = _steps(ctx)
    overrides = ["+experiment=llama500m_s99", *RUN_COMMON, "data.seq_len=4096",
                 "model.vocab_size=32000", f"trainer.max_steps={steps}",
                 f"optimizer.density_warmup_steps={max(1, steps // 4)}",
                 f"run_dir={ctx.tmp / f'run_{name}'}", *extra]
    if ctx.smoke:
        overrides = _with_toy(overrides, [
            "model=llama_tiny", "data.seq_len=64", "model.max_seq_len=64", "model.vocab_size=0",
            "trainer.micro_batch_size=2", "trainer.device=cpu", "trainer.log_every=2"])
    return overrides


def _logged_rows(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl being written."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def _train(ctx: Ctx, name: str, overrides: list[str], limit_s: float) -> dict:
    """One trainer run as a user starts it (``python -m scape_train``), stopped once its last
    step is logged: nothing of the end-of-run checkpoint is written."""
    steps = _steps(ctx)
    metrics = ctx.tmp / f"run_{name}" / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    log = open(ctx.tmp / f"train_{name}.log", "w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "scape_train", *overrides], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    rows: list[dict] = []
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        rows = _logged_rows(metrics)
        if any(r.get("step") == steps and "tokens_per_s" in r for r in rows):
            break
        time.sleep(0.2)
    rows = _logged_rows(metrics)
    done = any(r.get("step") == steps and "tokens_per_s" in r for r in rows)
    if proc.poll() is None:
        proc.kill()                 # SIGKILL: a SIGTERM would write the checkpoint we skip
    proc.wait()
    out = {"overrides": overrides, "wall_s": time.perf_counter() - t0, "completed": done}
    log.seek(0)
    text = log.read()
    # what the trainer chose: the memory plan's checkpointing pick, the compiled blocks, the
    # attention kernel
    out["chosen"] = [line.strip()[-160:] for line in text.splitlines()
                     if "activation checkpointing" in line or "compiled" in line
                     or "attention_backend=" in line][:5]
    if not done:
        out["log_tail"] = text.strip().splitlines()[-20:]
    logged = [r for r in rows if "tokens_per_s" in r]
    if logged:
        out["first_window"] = {k: logged[0].get(k) for k in ("step", "tokens_per_s", "mfu")}
        steady = logged[1:] or logged          # the first window holds the warm-up (and compile)
        for key in ("tokens_per_s", "mfu", "step_time_s", "time/fwd_bwd_s", "time/optimizer_s",
                    "time/data_s"):
            vals = [r[key] for r in steady if key in r]
            if vals:
                out[key] = statistics.median(vals)
        if "time/data_s" in out and out.get("step_time_s"):
            out["data_share_of_step"] = out["time/data_s"] / out["step_time_s"]
        peaks = [r["mem/allocated_gib"] for r in logged if "mem/allocated_gib" in r]
        out["max_memory_allocated_gib"] = max(peaks) if peaks else None
    return out


@check("train_throughput", 160, "llama500m_s99 and llama500m_adams as shipped (compile and "
       "checkpointing auto), and SCAPE-99 with selective checkpointing: vocabulary 32k, sequence "
       "4096, micro-batch 16, 20 steps: tokens/s, MFU, phase split")
def check_train(ctx: Ctx) -> dict:
    # the first run trains the data's tokenizer (cached for the rest) and compiles the blocks
    # (the inductor cache serves the second): the largest share of the time
    end = time.perf_counter() + ctx.limit_s - 5
    out = {}
    for (name, extra), share in zip(TRAIN_RUNS, (0.5, 0.45, 1.0)):
        out[name] = _train(ctx, name, _train_overrides(ctx, name, extra),
                           (end - time.perf_counter()) * share)
    return out


# (name, overrides on the shipped SCAPE-99 preset): where its MFU may be higher -- cuDNN's fused
# attention (on Hopper the kernel to try against FlashAttention-2; torch tries it last), half the
# micro-batch, the loss's chunk 4x larger or off
SWEEP_RUNS = (("cudnn_attention", ["trainer.attention_backend=cudnn"]),
              ("micro8", ["trainer.micro_batch_size=8"]),
              ("chunk32k", ["trainer.loss_chunk_tokens=32768"]),
              ("full_logits", ["trainer.loss_chunk_tokens=0"]))


@check("train_sweep", 280, "llama500m_s99 variants beside the shipped one: cuDNN attention, "
       "micro-batch 8, loss chunk 32k or off; 20 steps each: tokens/s, MFU, memory, the "
       "attention kernel (which setting the preset should ship)", optional=True)
def check_sweep(ctx: Ctx) -> dict:
    end = time.perf_counter() + ctx.limit_s - 5
    out = {}
    for i, (name, extra) in enumerate(SWEEP_RUNS):
        share = 1 / (len(SWEEP_RUNS) - i)           # what is left, split over the runs left
        out[name] = _train(ctx, name, _train_overrides(ctx, name, extra),
                           (end - time.perf_counter()) * share)
    done = {k: v["mfu"] for k, v in out.items() if v.get("completed") and v.get("mfu")}
    out["best_mfu"] = max(done.items(), key=lambda kv: kv[1]) if done else None
    return out


def _gpt2_overrides(ctx: Ctx, name: str) -> list[str]:
    """GPT-2 124M (12 x 768, vocabulary 50304 = 50257 padded to 64) at sequence 1024, micro-batch
    16, bf16, AdamW, compiled: nanoGPT's reference run."""
    steps = _steps(ctx)
    overrides = ["model=gpt_tiny", "model.n_layers=12", "model.d_model=768", "model.n_heads=12",
                 "model.ffn_dim=3072", "model.max_seq_len=1024", "model.vocab_size=50304",
                 "data.seq_len=1024", "trainer.micro_batch_size=16", "optimizer=adamw",
                 "trainer.precision=bf16", "trainer.compile=true", *RUN_COMMON,
                 f"trainer.max_steps={steps}", f"run_dir={ctx.tmp / f'run_{name}'}"]
    if ctx.smoke:
        overrides = _with_toy(overrides, [
            "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.ffn_dim=256",
            "model.max_seq_len=64", "model.vocab_size=0", "data.seq_len=64",
            "trainer.micro_batch_size=2", "trainer.device=cpu", "trainer.log_every=2",
            "trainer.precision=fp32", "trainer.compile=false"])
    return overrides


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from scape_train.config import register_configs, to_object

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(compose(config_name="config", overrides=overrides))


def _bare_loop(ctx: Ctx, cfg, steps: int, per_block: bool = False) -> dict:
    """The trainer's model and optimizer in nanoGPT's loop: random tokens already on the device,
    the whole model compiled (``per_block``: each block and the loss, as the trainer compiles
    them), forward/backward under autocast, the optimizer step; nothing else (no loader,
    metrics, hooks or loss agreement)."""
    import torch

    from scape_train.metrics import peak_flops
    from scape_train.models import build_model
    from scape_train.models.training import compile_enabled, prepare_for_training
    from scape_train.optim import build_optimizer
    from scape_train.train import autocast_context

    t = cfg.trainer
    vocab = cfg.model.vocab_size or cfg.data.tokenizer.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=vocab, device=ctx.device)
    model.loss_chunk_tokens = t.loss_chunk_tokens        # the trainer's loss
    strategy = build_optimizer(cfg.optimizer, model, total_steps=steps)
    compiled = compile_enabled(t.compile, ctx.device)
    fwd = torch.compile(model) if compiled and not per_block else model
    if per_block:
        prepare_for_training(model, "none", compiled, t.loss_chunk_tokens)
    autocast = autocast_context(cfg, ctx.device)
    shape = (t.micro_batch_size, cfg.data.seq_len)
    x = torch.randint(vocab, shape, device=ctx.device)
    y = torch.randint(vocab, shape, device=ctx.device)

    def step():
        with autocast():
            loss = fwd(x, targets=y)
        loss.backward()
        strategy.after_backward()
        strategy.step(cfg.optimizer.lr)
        strategy.zero_grad()

    warm = ctx.step_times(step, 3)                       # the compile happens here
    ctx.sync()                 # then one window, as the trainer's metrics time theirs
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ctx.sync()
    seconds = time.perf_counter() - start
    tok_s = t.micro_batch_size * cfg.data.seq_len * steps / seconds
    return {"warmup_s": warm, "tokens_per_s": tok_s, "step_time_s": seconds / steps,
            "mfu": model.flops_per_token(cfg.data.seq_len) * tok_s / peak_flops(ctx.device)}


@check("trainer_overhead", 63, "GPT-2 124M (seq 1024, micro 16, bf16, AdamW, compiled): the "
       "trainer's tokens/s against its own model and optimizer in a bare compiled loop")
def check_trainer_overhead(ctx: Ctx) -> dict:
    end = time.perf_counter() + ctx.limit_s - 5
    overrides = _gpt2_overrides(ctx, "gpt2")
    bare = _bare_loop(ctx, _compose(overrides), _steps(ctx) * 2)
    trainer = _train(ctx, "gpt2", overrides, end - time.perf_counter())
    out = {"bare_loop": bare, "trainer": trainer}
    if trainer.get("tokens_per_s"):
        out["trainer_over_bare"] = trainer["tokens_per_s"] / bare["tokens_per_s"]
    return out


@check("compile_granularity", 55, "GPT-2 124M in the bare loop compiled whole (nanoGPT) vs block "
       "by block with the loss (the trainer's way): what the granularity costs, apart from the "
       "trainer's loop", optional=True)
def check_compile_granularity(ctx: Ctx) -> dict:
    cfg = _compose(_gpt2_overrides(ctx, "gpt2"))
    whole = _bare_loop(ctx, cfg, _steps(ctx) * 2)
    blocks = _bare_loop(ctx, cfg, _steps(ctx) * 2, per_block=True)
    return {"whole_model": whole, "per_block": blocks,
            "per_block_over_whole": blocks["tokens_per_s"] / whole["tokens_per_s"]}


@check("memory_plan", 20, "the memory plan of the training runs vs their max_memory_allocated")
def check_plan(ctx: Ctx) -> dict:
    from scape_train.plan.check import device_for
    from scape_train.plan.estimate import plan_memory

    runs = ctx.results.get("train_throughput", {})
    results = {}
    for name, extra in TRAIN_RUNS:
        cfg = _compose(_train_overrides(ctx, name, extra))
        plan = plan_memory(cfg, 1, device_for(cfg.plan, 1, ctx.device.type, 0 if ctx.cuda else None),
                           trace=True)
        entry = {"estimate_gib": plan.peak / 2**30, "peak_phase": plan.peak_phase,
                 "measured_gib": runs.get(name, {}).get("max_memory_allocated_gib"),
                 "activation_checkpointing": plan.activation_checkpointing, "fits": plan.fits}
        if entry["measured_gib"]:
            entry["estimate_over_measured"] = entry["estimate_gib"] / entry["measured_gib"]
        results[name] = entry
    return results


def _passes_agree(ctx: Ctx, steps: int = 3) -> dict:
    """SCAPE's fused step with its Triton passes against the same step on torch ops: two copies of
    a 2-layer Llama-500M, the same gradients. CUDA's torch ops fuse multiply-adds where the
    kernels may round twice, so values agree to a tolerance, and a near-tie in top-k may pick
    another index: the masks must agree almost everywhere, not bit for bit."""
    import copy

    import torch

    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig

    model = _llama500m(ctx, n_layers=2)
    runs = []
    for use in ("on", "off"):
        m = copy.deepcopy(model)
        s = build_optimizer(OptimizerConfig(name="scape", density=0.01, clip_grad=1.0,
                                            use_triton=use), m)
        fill = _gradient_filler(ctx, list(m.parameters()), {"s": s})
        for i in range(steps):
            fill(1000 + i)
            s.step(1e-4)
        runs.append((torch.cat([p.detach().reshape(-1) for p in m.parameters()]),
                     s.mask_cur.clone()))
        s.close()
        del s, m
    (pa, ma), (pb, mb) = runs
    rel = float((pa - pb).abs().max() / pb.abs().max())
    agree = float((ma == mb).float().mean())
    return {"steps": steps, "mask_agreement": agree, "params_max_rel_diff": rel,
            "ok": agree >= 0.999 and rel <= 1e-5}


@check("triton_vs_torch", 20, "compiled Triton kernels vs the torch ops: mask packing bit for bit, "
       "SCAPE's fused step to a tolerance; the reference's gather with no host sync")
def check_triton(ctx: Ctx) -> dict:
    import torch

    from scape_train.optim.scape import kernels as K
    from scape_train.optim.scape.strategy import select_passes

    if not ctx.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "needs CUDA or TRITON_INTERPRET=1"}
    n = 1 << 12 if ctx.smoke else 1 << 26
    g = torch.Generator(device=ctx.device).manual_seed(0)
    values = torch.randn(n + 3, device=ctx.device, generator=g)[3:]        # storage offset
    mask = torch.rand(n, device=ctx.device, generator=g) < 0.01
    count = int(mask.sum())
    triton = select_passes("on", ctx.device)
    packed = {"torch": K.pack_bits(mask), "triton": triton.pack_bits(mask)}
    exact = {"pack": torch.equal(packed["torch"], packed["triton"]),
             "unpack": torch.equal(triton.unpack_bits(packed["triton"], n), mask),
             "gather": torch.equal(K.gather_masked(values, mask, count=count), values[mask])}
    out = {"numel": n, "exact": exact, "fused_step": _passes_agree(ctx, steps=2 if ctx.smoke else 3)}
    for b, lib in (("torch", select_passes("off", ctx.device)), ("triton", triton)):
        out[f"pack_{b}_s"] = statistics.median(ctx.step_times(lambda: lib.pack_bits(mask), 5))
    out["gather_s"] = statistics.median(ctx.step_times(
        lambda: K.gather_masked(values, mask, count=count), 5))
    out["sync_gather_with_count"] = first_cuda_sync(lambda: K.gather_masked(values, mask, count=count))
    out["ok"] = all(exact.values()) and out["fused_step"]["ok"]
    return out


@check("offload", 12, "residual offload (pinned host memory, side stream, double buffer) = on device")
def check_offload(ctx: Ctx) -> dict:
    import torch

    from scape_train.optim.scape.residual import ResidualStore

    n = (1 << 27) + 5 if not ctx.smoke else 10_007
    g = torch.Generator(device=ctx.device).manual_seed(1)
    w0 = torch.randn(n, device=ctx.device, generator=g)
    mask = torch.rand(n, device=ctx.device, generator=g) < 0.01
    stores = {off: ResidualStore(n, ctx.device, off, 1 << 22) for off in (False, True)}
    res = {}
    for off, st in stores.items():
        st.load(torch.randn(n, generator=torch.Generator().manual_seed(2)).to(ctx.device))
        w = w0.clone()
        sq = st.fold(w, mask)
        res[off] = (w, st.full(), sq)
    out = {"numel": n, "pinned": stores[True]._host.pinned,
           "w_equal": torch.equal(res[False][0], res[True][0]),
           "residual_equal": torch.equal(res[False][1], res[True][1]),
           # registered at its size, not rounded up to a power of two by the caching allocator
           "host_bytes_asked": 4 * n,
           "host_bytes_pinned": stores[True]._host.host.untyped_storage().nbytes(),
           "host_is_pinned": stores[True]._host.host.is_pinned(),
           # the fold queues its copies and returns: no wait on the host
           "fold_offload_cuda_sync": first_cuda_sync(lambda: stores[True].fold(w0.clone(), mask))}
    for off, st in stores.items():
        out[f"fold_{'offload' if off else 'device'}_s"] = statistics.median(
            ctx.step_times(lambda: st.fold(w0.clone(), mask), 3))
    out["fold_bytes_per_s_offload"] = (n * 4 * 2) / out["fold_offload_s"]
    return out


@check("env", 10, "device, driver, torch/triton/NCCL versions")
def check_env(ctx: Ctx) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_available": ctx.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=p.total_memory / 2**30,
                   sms=p.multi_processor_count, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   devices=torch.cuda.device_count())
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True)
        out["nvidia_smi"] = smi.stdout.strip()
    return out


# elastic DiLoCo at toy size: what the check proves is the exchange of device tensors across
# replica groups, not speed
ELASTIC_JOB = ["model=llama_tiny", "data=classics", "data.seq_len=128", "trainer.micro_batch_size=4",
               "strategy=diloco", "strategy.inner_steps=5", "trainer.max_steps=15",
               "trainer.warmup_steps=2", "trainer.log_every=5", "trainer.eval_every=0",
               "trainer.checkpoint_every=0", "trainer.sample_tokens=0", "eval.enabled=false",
               "logging.wandb.mode=disabled", "logging.progress_bar=false", "plan.check=off",
               "strategy.elastic.enabled=true"]
# (name, strategy.elastic.backend, workers): two workers share the one GPU through gloo (NCCL
# refuses two ranks on one device); one worker forms its NCCL group alone
ELASTIC_RUNS = (("gloo_pair", "gloo", 2), ("nccl_single", "auto", 1))


@check("elastic", 60, "elastic DiLoCo with its workers on the GPU: 2 replica groups exchanging "
       "CUDA tensors through torchft's gloo group, 1 through its NCCL group (backend auto); 3 "
       "rounds each: committed rounds, the pair's parameters equal", optional=True)
def check_elastic(ctx: Ctx) -> dict:
    from scape_train.checkpoint import CheckpointManager
    from scape_train.elastic.replica import EVENTS_FILE, import_torchft

    import_torchft()
    import torch
    from torchft.coordination import LighthouseServer

    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    servers, procs = [], {}
    for name, backend, workers in ELASTIC_RUNS:
        server = LighthouseServer(bind="[::]:0", min_replicas=workers, join_timeout_ms=2000)
        servers.append(server)
        for slot in range(workers):
            run_dir = ctx.tmp / f"elastic_{name}_{slot}"
            cmd = [sys.executable, "-m", "scape_train", *ELASTIC_JOB, f"run_dir={run_dir}",
                   f"strategy.elastic.lighthouse={server.address()}",
                   f"strategy.elastic.replica={slot}", f"strategy.elastic.slots={workers}",
                   f"strategy.elastic.backend={backend}",
                   *(["trainer.device=cpu"] if ctx.smoke else [])]
            log = open(ctx.tmp / f"elastic_{name}_{slot}.log", "w+")
            procs[(name, slot)] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT), log, run_dir)
    deadline = time.perf_counter() + ctx.limit_s - 5
    out: dict = {}
    try:
        for (name, slot), (proc, log, run_dir) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            text = log.read()
            events = run_dir / EVENTS_FILE
            rows = [json.loads(line) for line in events.read_text().splitlines()] \
                if events.exists() else []
            worker = {"returncode": proc.returncode,
                      "committed_rounds": sum(1 for r in rows if r.get("committed")),
                      **_exchange_line(text)}
            if proc.returncode != 0:
                worker["log_tail"] = text.strip().splitlines()[-15:]
            out.setdefault(name, {})[f"worker_{slot}"] = worker
    finally:
        for server in servers:
            server.shutdown()
    pair = [CheckpointManager(ctx.tmp / f"elastic_gloo_pair_{slot}" / "checkpoints",
                              None).latest_valid() for slot in range(2)]
    if all(pair):
        a, b = (torch.load(path / "model.pt", map_location="cpu", weights_only=True)
                for path in pair)
        out["gloo_pair"]["same_parameters"] = a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) for k in a)
    workers = [w for run in out.values() for k, w in run.items() if k.startswith("worker_")]
    single = out.get("nccl_single", {}).get("worker_0", {})
    out["ok"] = bool(out.get("gloo_pair", {}).get("same_parameters")) and all(
        w["returncode"] == 0 and w["committed_rounds"] == 3 for w in workers) and \
        single.get("backend") == ("nccl" if ctx.cuda else "gloo")
    return out


def _exchange_line(text: str) -> dict:
    """The device and backend an elastic worker logged for its exchange (``ReplicaGroup``)."""
    for line in text.splitlines():
        if "across replica groups over backend" in line:
            return {"device": line.split("exchanges its ")[-1].split()[0],
                    "backend": line.split("over backend ")[-1].split()[0]}
    return {"device": None, "backend": None}


@check("overlap_trace", 60, "2 GPUs only: the mask all-gather in flight during the next fwd/bwd")
def check_overlap(ctx: Ctx) -> dict:
    import torch

    if not ctx.cuda or torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs (NCCL refuses two ranks on one device)"}
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
           "SCAPE_TRACE_OUT": str(ctx.tmp)}          # the traces stay out of $OUT
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(REPO / "scripts" / "gpu_overlap.py")],
                          cwd=REPO, env=env, capture_output=True, text=True)
    out = {"returncode": proc.returncode, "stdout_tail": proc.stdout.strip().splitlines()[-10:]}
    summary = ctx.tmp / "overlap_summary.json"
    if summary.exists():
        out.update(json.loads(summary.read_text()))
    return out
