"""Throughput, MFU, memory, and the sinks: console progress bar, ``metrics.jsonl``, W&B.

MFU = (model FLOPs per token x tokens per second) / (peak FLOP/s per device x devices).
Model FLOPs per token come from the model (``flops_per_token``: 6 x non-embedding parameters
including the output layer, plus 12 x layers x width x sequence length for attention scores), the
peak from the table below: dense bf16 tensor-core figures for GPUs; for CPUs a nominal fp32 peak
of threads x 2.5 GHz x FLOPs/cycle (32 with AVX2 FMA, 64 with AVX-512), which is a stated
assumption, not a measurement.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Dense (non-sparse) bf16 peak FLOP/s per device, from the vendors' data sheets.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,   # SXM; the PCIe part is 756e12
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
}


def cpu_peak_flops(threads: int) -> float:
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 8
    return threads * 2.5e9 * per_cycle


def peak_flops(device: torch.device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name and "PCIe" in name:
            return 756e12
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value
        log.warning("no peak FLOP/s known for %r; MFU assumes an H100", name)
        return GPU_PEAK_FLOPS["H100"]
    return cpu_peak_flops(torch.get_num_threads())


def memory_metrics(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"mem/allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "mem/reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"mem/rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class StepTimer:
    """Accumulates named phases (data, fwd_bwd, optimizer) between ``pop()`` calls.

    On CUDA a phase is timed by two events on the current stream, and the events are read only in
    ``pop()`` (at a log step): no synchronization inside the step, so the host runs ahead of the
    GPU and an asynchronous collective (SCAPE's next-mask all-gather) stays overlapped with the
    next forward/backward. The figures are then GPU time between the phase boundaries. On the
    CPU the host clock is the device clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self_inner):
                if timer.cuda:
                    self_inner.start = torch.cuda.Event(enable_timing=True)
                    self_inner.start.record()
                else:
                    self_inner.t0 = time.perf_counter()

            def __exit__(self_inner, *exc):
                if timer.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    timer._events.append((name, self_inner.start, end))
                else:
                    timer.totals[name] = (timer.totals.get(name, 0.0)
                                          + time.perf_counter() - self_inner.t0)

        return _Phase()

    def pop(self) -> dict[str, float]:
        for name, start, end in self._events:
            end.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._events = []
        out, self.totals = self.totals, {}
        return out


def read_on_host(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with every tensor value read to a Python number, in one device read."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return metrics
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values))}


class MetricsLogger:
    """Rank 0 writes ``metrics.jsonl``, W&B and the progress bar; other ranks log nothing."""

    def __init__(self, run_dir: Path, is_main: bool, total_steps: int, progress_bar: bool,
                 wandb_run=None, start_step: int = 0):
        self.is_main, self.wandb_run = is_main, wandb_run
        self.path = Path(run_dir) / "metrics.jsonl"
        if is_main:   # a resumed run continues one record: the steps it replays are dropped first
            dropped = truncate_metrics(self.path, start_step)
            if dropped:
                log.info("metrics.jsonl: dropped %d rows logged after step %d (replayed now)",
                         dropped, start_step)
        self._file = open(self.path, "a") if is_main else None
        self.bar = None
        self._shown: dict[str, str] = {}
        if is_main and progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=1.0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "time"}, step=step)
        if self.bar is not None:
            # The last value of each shown metric stays until the next one arrives.
            self._shown.update(bar_fields(metrics))
            self.bar.set_postfix(self._shown, refresh=False)
        elif "loss" in metrics or "val_loss" in metrics:
            log.info("step %d %s", step, " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._file is not None:
            self._file.close()


# Progress-bar fields: (metric, label, scale). The optimizer-specific ones appear when the
# strategy reports them: SCAPE its density and the MB it sends per step (payload + mask),
# DiLoCo / GASLoC the outer round, an elastic run the workers in the current quorum.
BAR_FIELDS = (("loss", "loss", 1.0), ("val_loss", "val_loss", 1.0), ("lr", "lr", 1.0),
              ("scape/density", "density", 1.0), ("comm/sent_bytes", "MB/step", 1e-6),
              ("outer/round", "round", 1.0), ("elastic/quorum", "quorum", 1.0),
              ("tokens_per_s", "tok/s", 1.0), ("mfu", "mfu", 1.0))
_COUNTS = ("outer/round", "elastic/quorum")


def bar_fields(metrics: dict[str, Any]) -> dict[str, str]:
    """The progress bar's formatted fields among ``metrics``."""
    out = {}
    for key, label, scale in BAR_FIELDS:
        v = metrics.get(key)
        if not isinstance(v, (int, float)) or (key == "comm/sent_bytes" and v <= 0):
            continue
        out[label] = f"{int(v)}" if key in _COUNTS else f"{v * scale:.3g}"
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def continued_rows(path: Path, step: int) -> list[dict]:
    """The rows of one continuous record up to ``step``: rows after it are dropped (a run that
    resumes from the checkpoint of ``step`` logs them again), and so are rows an earlier resume
    replayed (a row whose step goes back replaces everything logged from that step on), and a
    torn last line left by a crash."""
    rows: list[dict] = []
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
            s = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if rows and s < rows[-1]["step"]:
            rows = [r for r in rows if r["step"] < s]
        rows.append(row)
    return [r for r in rows if r["step"] <= step]


def truncate_metrics(path: Path, step: int) -> int:
    """Rewrite ``path`` as ``continued_rows(path, step)``, atomically (a temporary file, fsync,
    rename); untouched when nothing is dropped. Rank 0 only. Returns the rows dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    total = sum(1 for line in path.read_bytes().splitlines() if line.strip())
    keep = continued_rows(path, step)
    if len(keep) == total:
        return 0
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return total - len(keep)


def plot_loss_curve(metrics_path: Path, out_png: Path) -> Path:
    """Train and validation loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def env_snapshot() -> dict[str, str]:
    """Versions for the run record; never environment variables (they may hold secrets)."""
    import platform

    return {"torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "pid": str(os.getpid())}
