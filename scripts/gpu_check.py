#!/usr/bin/env python
"""The one prepared GPU check: every CUDA/NCCL path of the project, measured, in under 8 minutes.

    bash scripts/gpu_check.sh             # on a machine with a GPU (installs carried wheels first)
    bash scripts/gpu_check.sh --dry-run   # lists the checks; runs nothing (CPU, CI)
    python scripts/gpu_check.py --smoke   # the checks that can, at toy sizes on the CPU (CI)

Each check runs in turn, isolated (one failing check is reported and the next one runs), with its
own time budget; the figures go to ``gpu_check.json`` and ``gpu.md`` (and traces) under ``--out``
($OUT on the device machine, else ``docs/``). Timings use CUDA events (median of repeats after
warm-up); host syncs are those CUDA itself reports (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHECKS: dict[str, tuple[str, callable]] = {}


def check(name: str, what: str):
    def deco(fn):
        CHECKS[name] = (what, fn)
        return fn
    return deco


class Ctx:
    def __init__(self, out: Path, smoke: bool):
        import torch

        self.out, self.smoke = out, smoke
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def timed(self, fn, repeats: int = 10, warmup: int = 3, before=None) -> dict[str, float]:
        """Median/min/max seconds of ``fn()`` (device time between events on CUDA)."""
        import torch

        times = []
        for i in range(warmup + repeats):
            if before is not None:
                before(i)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
        return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                "n": len(times)}


def cuda_syncs(fn) -> int:
    """Synchronizing CUDA calls made by ``fn()``, as CUDA's own sync-debug mode reports them."""
    import torch

    if not torch.cuda.is_available():
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------ checks

@check("env", "device, driver, torch/triton/NCCL versions")
def check_env(ctx: Ctx) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_available": ctx.cuda}
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=p.total_memory / 2**30,
                   sms=p.multi_processor_count, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   devices=torch.cuda.device_count())
        try:
            import triton
            out["triton"] = triton.__version__
        except ImportError:
            out["triton"] = None
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True)
        out["nvidia_smi"] = smi.stdout.strip()
    return out


@check("cuda_tests", "the test files whose CUDA cases skip on CPU, with compiled Triton")
def check_cuda_tests(ctx: Ctx) -> dict:
    if ctx.smoke:
        return {"skipped": "smoke mode runs no pytest"}
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    files = ["tests/test_kernels.py", "tests/test_offload.py", "tests/test_nccl_rules.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timeout=240", *files], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "", "tail": tail}


@check("triton_vs_torch", "compiled Triton pack/unpack/gather/scatter equal the torch path; times")
def check_triton(ctx: Ctx) -> dict:
    import torch

    from scape_train.optim.scape import kernels as K

    if not ctx.cuda:
        return {"skipped": "needs CUDA (the interpreter path is tested in the suite)"}
    n = 1 << 26 if not ctx.smoke else 1 << 12
    out = {"numel": n + 3}
    g = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn(n + 3, device="cuda", generator=g)[3:]            # storage offset
    mask = torch.rand(n, device="cuda", generator=g) < 0.01
    count = int(mask.sum())
    packed = {b: K.pack_bits(mask, backend=b) for b in ("torch", "triton")}
    out["pack_equal"] = torch.equal(packed["torch"], packed["triton"])
    out["unpack_equal"] = torch.equal(K.unpack_bits(packed["triton"], n, backend="triton"), mask)
    gath = {b: K.gather_masked(values, mask, backend=b, count=count) for b in ("torch", "triton")}
    out["gather_equal"] = torch.equal(gath["torch"], gath["triton"])
    out["gather_packed_equal"] = torch.equal(
        K.gather_masked_packed(values, packed["triton"], backend="triton"), gath["torch"])
    dst = {b: torch.zeros_like(values) for b in ("torch", "triton")}
    for b in dst:
        K.scatter_masked(gath["torch"], mask, dst[b], backend=b, count=count)
    out["scatter_equal"] = torch.equal(dst["torch"], dst["triton"])
    for b in ("torch", "triton"):
        out[f"gather_{b}"] = ctx.timed(lambda: K.gather_masked(values, mask, backend=b, count=count))
        out[f"scatter_{b}"] = ctx.timed(
            lambda: K.scatter_masked(gath["torch"], mask, dst[b], backend=b, count=count))
        out[f"pack_{b}"] = ctx.timed(lambda: K.pack_bits(mask, backend=b))
    out["syncs_gather_triton_with_count"] = cuda_syncs(
        lambda: K.gather_masked(values, mask, backend="triton", count=count))
    out["syncs_gather_torch_with_count"] = cuda_syncs(
        lambda: K.gather_masked(values, mask, backend="torch", count=count))
    return out


@check("offload", "residual offload (pinned host memory, side stream, double buffer) = on device")
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
           "residual_equal": torch.equal(res[False][1], res[True][1])}
    for off, st in stores.items():
        out[f"fold_{'offload' if off else 'device'}"] = ctx.timed(
            lambda: st.fold(w0.clone(), mask), repeats=5, warmup=2)
    out["fold_bytes_per_s_offload"] = (n * 4 * 2) / out["fold_offload"]["median_s"]
    return out


def _llama500m(ctx: Ctx):
    import torch

    from scape_train.models import build_model
    from scape_train.models.config import ModelConfig

    if ctx.smoke:
        cfg = ModelConfig(name="smoke", arch="llama", n_layers=2, d_model=64, n_heads=4,
                          n_kv_heads=2, ffn_dim=128, max_seq_len=64, vocab_size=256)
    else:
        cfg = ModelConfig(name="llama500m", arch="llama", n_layers=16, d_model=1536, n_heads=16,
                          n_kv_heads=8, ffn_dim=4096, max_seq_len=4096, vocab_size=32000,
                          vocab_pad_multiple=1, rope_theta=100000.0, tie_embeddings=False)
    torch.manual_seed(0)
    return build_model(cfg, vocab_size=cfg.vocab_size, device=ctx.device)


def _passes_agree(model, fill, triton: str, steps: int = 3) -> dict:
    """The Triton passes against the torch ops: two copies of the model, the same gradients,
    ``steps`` SCAPE steps each; masks must match, parameters agree to a few ulps."""
    import copy

    import torch

    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig

    runs = []
    for use in (triton, "off"):
        m = copy.deepcopy(model)
        s = build_optimizer(OptimizerConfig(name="scape", density=0.1, clip_grad=1.0,
                                            use_triton=use), m)
        for i in range(steps):
            fill(1000 + i)
            for p, q in zip(model.parameters(), m.parameters()):
                q.grad = p.grad.clone()
            s.step(1e-4)
        runs.append((torch.cat([p.detach().reshape(-1) for p in m.parameters()]),
                     s.mask_cur.clone()))
        s.close()
        del s, m
    (pa, ma), (pb, mb) = runs
    return {"use_triton": triton, "steps": steps, "masks_equal": bool(torch.equal(ma, mb)),
            "params_max_abs_diff": float((pa - pb).abs().max()),
            "params_max_abs": float(pb.abs().max())}


@check("scape_vs_adams_step", "one-GPU SCAPE step vs dense AdamS step at Llama-500M shapes")
def check_scape_step(ctx: Ctx) -> dict:
    import torch

    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig
    from scape_train.optim.grad_buffer import write_grads
    from scape_train.optim.scape.accounting import dense_allreduce_bytes, scape_step_bytes
    from scape_train.profiling import DeviceOpCounter

    model = _llama500m(ctx)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    current: dict = {}          # the strategy being timed: gradients go to its flat buffer

    def fill(i):
        g = torch.Generator(device=ctx.device).manual_seed(i)
        write_grads(params, [torch.randn(p.shape, device=ctx.device, generator=g).mul_(1e-2)
                             for p in params], getattr(current.get("s"), "grad_buffer", None))

    if not ctx.cuda:   # the CPU smoke counts what a GPU runs: the static-size path
        from scape_train.optim.scape import kernels

        kernels.HOST_READS_ON_CPU = False
    out = {"params": n}
    # SCAPE's fused passes as Triton kernels (use_triton=on; auto picks them on CUDA) and as the
    # torch ops they replace; on the CPU smoke the Triton ones run interpreted, when they can
    triton = "on" if ctx.cuda or os.environ.get("TRITON_INTERPRET") == "1" else "off"
    contenders = {"adams": dict(name="adams", clip_grad=1.0)}
    for d in (0.1, 0.01):
        contenders[f"scape_d{d}"] = dict(name="scape", density=d, clip_grad=1.0,
                                         use_triton=triton)
        contenders[f"scape_d{d}_torch_ops"] = dict(name="scape", density=d, clip_grad=1.0,
                                                   use_triton="off")
    contenders["scape_sharded_d0.01"] = dict(name="scape", density=0.01, clip_grad=1.0,
                                             sharded=True, use_triton=triton)
    out["triton_vs_torch_ops"] = _passes_agree(model, fill, triton)
    for name, kw in contenders.items():
        strategy = current["s"] = build_optimizer(OptimizerConfig(**kw), model)
        fill(0)
        strategy.step(1e-4)                       # the first step builds SCAPE's first mask
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        res = ctx.timed(lambda: strategy.step(1e-4), repeats=5 if ctx.smoke else 10,
                        before=fill)
        fill(99)
        res["cuda_syncs_per_step"] = cuda_syncs(lambda: strategy.step(1e-4))
        fill(98)
        with DeviceOpCounter() as ops:
            strategy.step(1e-4)
        res["dispatched_launches_per_step"] = ops.launches
        res["bytes_per_param"] = ops.bytes_moved / n    # dispatched ops + counted passes
        res["counted_host_syncs_per_step"] = ops.host_syncs
        if ctx.cuda:
            res["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        strategy.close()
        out[name] = res
        del strategy
        current.clear()
        for p in params:            # the flat buffer's views would keep it alive
            p.grad = None
        if ctx.cuda:
            torch.cuda.empty_cache()
    for name in contenders:
        if name != "adams":
            out[f"{name}_over_adams"] = out[name]["median_s"] / out["adams"]["median_s"]
    layout = build_optimizer(OptimizerConfig(name="scape", density=0.01), model).layout
    out["bytes_per_rank_n8"] = {"dense_fp32_allreduce": dense_allreduce_bytes(layout, 8),
                                **{f"scape_d{d}": scape_step_bytes(layout, 8, d, partitioner="flat")
                                   .as_dict() for d in (0.1, 0.01)}}
    return out


def _train(ctx: Ctx, run_dir: Path, extra: list[str], steps: int) -> dict:
    """One trainer run (a subprocess, as a user runs it); its logged figures."""
    overrides = ["+experiment=llama500m_s99", "data=classics", f"trainer.max_steps={steps}",
                 "trainer.warmup_steps=2", "trainer.log_every=5", "trainer.eval_every=0",
                 "trainer.checkpoint_every=0", "trainer.global_batch_size=0", "eval.enabled=false",
                 "logging.wandb.mode=disabled", "logging.progress_bar=false",
                 f"optimizer.density_warmup_steps={max(1, steps // 4)}", f"run_dir={run_dir}", *extra]
    if ctx.smoke:
        overrides += ["model=llama_tiny", "data.seq_len=64", "model.max_seq_len=64",
                      "trainer.micro_batch_size=2", "trainer.device=cpu", "plan.check=off"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scape_train", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    out = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
           "overrides": overrides}
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr.strip().splitlines()[-20:]
        return out
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "tokens_per_s" in r][1:] or [r for r in rows if "tokens_per_s" in r]
    for key in ("tokens_per_s", "mfu", "step_time_s", "mem/allocated_gib", "time/fwd_bwd_s",
                "time/optimizer_s", "time/data_s"):
        vals = [r[key] for r in logged if key in r]
        if vals:
            out[key] = statistics.median(vals) if key != "mem/allocated_gib" else max(vals)
    return out


@check("train_throughput", "bf16 tokens/s and MFU of llama500m (SCAPE-99 and dense AdamS), 20 steps")
def check_train(ctx: Ctx) -> dict:
    steps = 4 if ctx.smoke else 20
    return {name: _train(ctx, ctx.out / f"run_{name}", extra, steps)
            for name, extra in (("scape99", []), ("adams", ["optimizer=adams"]))}


@check("memory_plan", "the memory plan's estimate vs torch.cuda.max_memory_allocated")
def check_plan(ctx: Ctx) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from scape_train.config import register_configs, to_object
    from scape_train.plan.check import device_for
    from scape_train.plan.estimate import plan_memory

    register_configs()
    results = {}
    for name, run in ctx.results.get("train_throughput", {}).items():
        if not isinstance(run, dict) or "overrides" not in run:
            continue
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = to_object(compose(config_name="config", overrides=run["overrides"]))
        plan = plan_memory(cfg, 1, device_for(cfg.plan, 1, ctx.device.type, 0 if ctx.cuda else None),
                           trace=True)
        entry = {"estimate_gib": plan.peak / 2**30, "peak_phase": plan.peak_phase,
                 "measured_gib": run.get("mem/allocated_gib"), "fits": plan.fits}
        if entry["measured_gib"]:
            entry["estimate_over_measured"] = entry["estimate_gib"] / entry["measured_gib"]
        results[name] = entry
    return results


@check("overlap_trace", "profiler trace: the mask all-gather in flight during the next fwd/bwd")
def check_overlap(ctx: Ctx) -> dict:
    import torch

    if not ctx.cuda or torch.cuda.device_count() < 2:
        # NCCL refuses two ranks on one GPU: with one device there is no all-gather to overlap.
        out = {"skipped": "needs 2 GPUs (NCCL refuses two ranks on one device)"}
        if ctx.cuda and not ctx.smoke:
            out["single_rank_trace"] = _trace_single(ctx)
        return out
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
           "SCAPE_TRACE_OUT": str(ctx.out)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(REPO / "scripts" / "gpu_overlap.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = {"returncode": proc.returncode, "stdout_tail": proc.stdout.strip().splitlines()[-10:]}
    summary = ctx.out / "overlap_summary.json"
    if summary.exists():
        out.update(json.loads(summary.read_text()))
    return out


def _trace_single(ctx: Ctx) -> str:
    """A chrome trace of three SCAPE steps of one rank (kernels, streams), for reading."""
    import gzip

    import torch

    from scape_train.optim import build_optimizer
    from scape_train.optim.config import OptimizerConfig

    model = _llama500m(ctx)
    strategy = build_optimizer(OptimizerConfig(name="scape", density=0.01), model)
    x = torch.randint(0, 32000, (4, 1024), device=ctx.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
            loss.backward()
            strategy.step(1e-4)
            strategy.zero_grad()
        torch.cuda.synchronize()
    raw = ctx.out / "trace_scape_1rank.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
        g.write(f.read())
    raw.unlink()
    return str(raw) + ".gz"


# ------------------------------------------------------------------------------------------ report

def write_report(ctx: Ctx, results: dict, seconds: dict) -> None:
    (ctx.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    lines = ["# GPU check", "", f"`scripts/gpu_check.sh` ({'smoke, CPU' if ctx.smoke else 'device'}); "
             f"written {time.strftime('%Y-%m-%d %H:%M')}. Every figure is in `gpu_check.json`.", ""]
    for name, res in results.items():
        what = CHECKS[name][0]
        lines += [f"## {name}: {what}", "", f"{seconds.get(name, 0):.1f} s", "", "```",
                  json.dumps(res, indent=1, default=str)[:6000], "```", ""]
    (ctx.out / "gpu.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    ap.add_argument("--smoke", action="store_true", help="toy sizes; CPU-capable checks only")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "docs"))
    args = ap.parse_args()
    names = [n for n in CHECKS if not args.only or n in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - set(CHECKS)
    if unknown:
        print(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    if args.dry_run:
        for n in names:
            print(f"{n:22s} {CHECKS[n][0]}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out, args.smoke)
    ctx.results = results = {}
    seconds = {}
    failed = []
    for n in names:
        t0 = time.perf_counter()
        print(f"== {n}: {CHECKS[n][0]}", flush=True)
        try:
            results[n] = CHECKS[n][1](ctx)
        except Exception:  # report, then go on: one broken check must not hide the others
            results[n] = {"error": traceback.format_exc().splitlines()[-12:]}
            failed.append(n)
        seconds[n] = time.perf_counter() - t0
        print(json.dumps(results[n], default=str)[:2000], flush=True)
        write_report(ctx, results, seconds)      # after each check: a timeout keeps the rest
    print(f"checks failed: {failed or 'none'}; report: {out / 'gpu.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
