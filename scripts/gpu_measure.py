"""What the checks of ``scripts/gpu_checks.py`` share: their registry, the context each runs in,
device timing, and two probes: the first synchronizing CUDA call (named) and the profiler's top
kernels."""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHECKS: dict[str, tuple[str, float, callable]] = {}     # name -> (what, limit_s, fn), in order
OPTIONAL: set[str] = set()      # run only when named (``--only``): a lease's second call


def check(name: str, limit_s: float, what: str, optional: bool = False):
    def deco(fn):
        CHECKS[name] = (what, limit_s, fn)
        if optional:
            OPTIONAL.add(name)
        return fn
    return deco


class Ctx:
    def __init__(self, tmp: Path, smoke: bool, results: dict, limit_s: float):
        import torch

        self.tmp, self.smoke, self.results, self.limit_s = tmp, smoke, results, limit_s
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def step_times(self, fn, n: int, before=None) -> list[float]:
        """Seconds of each of ``n`` calls of ``fn()``: device time between events on CUDA."""
        import torch

        times = []
        for i in range(n):
            if before is not None:
                before(i)
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times


def sync_site(exc: BaseException) -> str:
    """Where a synchronizing call was made: the innermost frame of the project (else the
    innermost of all) in ``exc``'s traceback, as ``path:line in function: code``."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if str(REPO) in f.filename and "scripts/gpu_check" not in f.filename]
    f = (ours or frames)[-1]
    path = Path(f.filename)
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return f"{where}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def first_cuda_sync(fn) -> dict:
    """Runs ``fn()`` under ``torch.cuda.set_sync_debug_mode("error")``: CUDA raises at the first
    synchronizing call (``"warn"`` mode's warnings include some that are not syncs). Returns
    ``{"syncs": 0}`` or ``{"syncs": 1, "call": <where>, "error": <message>}`` (counted up to the
    first: ``fn`` stops there). Run it last on a strategy: an interrupted step leaves it half done."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return {"syncs": 1, "call": sync_site(exc), "error": str(exc).splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"syncs": 0}


def top_kernels(ctx: "Ctx", fn, n: int = 10) -> dict:
    """torch.profiler over one ``fn()``: the ``n`` largest rows by self device time, kernels
    only on CUDA (an operator's row repeats its kernels' time), operators by self CPU time on
    the CPU; ``total_ms`` sums the rows so ranked."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    ctx.sync()
    with profile(activities=activities) as prof:
        fn()
        ctx.sync()
    rows = []
    for e in prof.key_averages():
        if ctx.cuda and e.device_type != DeviceType.CUDA:
            continue
        us = e.self_device_time_total if ctx.cuda else e.self_cpu_time_total
        rows.append({"name": e.key[:160], "calls": e.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return {"by": "self device time, kernels" if ctx.cuda else "self CPU time, operators",
            "total_ms": sum(r["ms"] for r in rows), "top": rows[:n]}
