"""Process-group set-up, rank/world, device choice and the one run directory all ranks share.

Under ``torchrun`` (WORLD_SIZE > 1 in the environment) the process group is initialised with
NCCL on GPUs and gloo on CPUs; without it the same code runs as a single process. Every
collective, start-up and checkpoint agreement included, goes through ``info.comm``
(``comm.py``): device tensors only, counted.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from scape_train.comm import Comm, enforce_comm_only_from_env


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False          # this process created the group here, so it destroys it
    comm: Comm = field(default_factory=Comm)   # the default group's counted collectives

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: int = 600) -> DistInfo:
    """Initialise torch.distributed from torchrun's environment (no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    owns = False
    if world > 1 and not dist.is_initialized():
        owns = True
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = _dt.timedelta(seconds=timeout_s)
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None and os.environ.get("GROUP_WORLD_SIZE") == "1":
            # torchrun keeps its store across restarts of the worker group: without a prefix per
            # attempt, a restarted rank can read the dead group's addresses and fail to connect.
            # (Single node only: on several nodes the restart count can differ between nodes.)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            kwargs.update(store=dist.PrefixStore(f"scape_attempt_{restart}", store), rank=rank,
                          world_size=world)
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    enforce_comm_only_from_env()
    # gloo takes CPU tensors; NCCL, and one process without a group, the training device's
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    comm = Comm(device=torch.device("cpu") if gloo else dev)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, owns_group=owns,
                    comm=comm)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group if ``init_distributed`` created it. A group the caller made (a
    test harness, an embedding program) is left to the caller: destroying it and making a new
    one on the same store races with ranks still using the old one."""
    if info.owns_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank."""
    return info.comm.broadcast_object(obj)


def barrier(info: DistInfo) -> None:
    info.comm.barrier()


def resolve_run_dir(run_dir: str | None, run_name: str, resume: str, info: DistInfo) -> Path:
    """The run directory, chosen by rank 0 and broadcast so every rank agrees.

    An explicit ``run_dir`` is used as given. Otherwise ``outputs/<run_name>/<timestamp>``; with
    ``resume=auto`` the newest existing run of that name that holds a checkpoint is continued.
    """
    chosen = None
    if info.is_main:
        if run_dir:
            chosen = str(Path(run_dir).resolve())
        else:
            base = Path("outputs") / run_name
            if resume == "auto" and base.is_dir():
                with_ckpt = sorted(p for p in base.iterdir() if (p / "checkpoints").is_dir())
                if with_ckpt:
                    chosen = str(with_ckpt[-1].resolve())
            if chosen is None:
                stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
                chosen = str((base / stamp).resolve())
        Path(chosen).mkdir(parents=True, exist_ok=True)
    chosen = broadcast_object(chosen, info)
    return Path(chosen)
