"""The devices a plan is checked against, and the safety margin kept on each.

GPU capacities are what ``torch.cuda.get_device_properties(i).total_memory`` (= nvidia-smi's
total) reports for each card, not the marketing figure: an "80 GB" H100 has 81,559 MiB = 79.6 GiB.
``cpu`` is the host's MemAvailable (/proc/meminfo) shared by the ranks of this host; ``auto`` is the
current CUDA device, else ``cpu``.

The margin. The plan counts the bytes of live tensors (what ``torch.cuda.max_memory_allocated``
reports on a GPU); a process needs more than that:

- a fixed reserve: on a GPU, 2 GiB for the CUDA context and kernel images (~0.5-1 GiB on H100 with
  lazy module loading), cuBLAS/cuDNN workspaces and NCCL's communication buffers (a few hundred MiB
  per communicator); on the host, 0.5 GiB for the interpreter's own growth, the tokenizer, the data
  loader's queue and the checkpoint writer's buffers;
- then a share of the rest for allocator fragmentation. GPU 10%: the CUDA caching allocator's
  reserved memory typically runs 5-10% above its allocated memory in steady training (blocks are
  rounded up and split; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lowers it). Host 20%:
  glibc's dynamic mmap threshold keeps freed tensors under 32 MiB in its heap, and on the plan's
  CPU validation runs the resident peak exceeded the live tensor bytes by 8-20%
  (docs/memory_plan.md).

So usable = (capacity - reserve) x (1 - fragmentation); the plan fits when its peak is at most that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
FRAGMENTATION = {"gpu": 0.10, "cpu": 0.20}
GPU_RESERVE = 2 * GiB
HOST_RESERVE = GiB // 2


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str                 # "gpu" | "cpu"
    capacity: int             # bytes one rank may use before the margin
    note: str = ""

    @property
    def reserve(self) -> int:
        return GPU_RESERVE if self.kind == "gpu" else HOST_RESERVE

    @property
    def fragmentation(self) -> float:
        return FRAGMENTATION[self.kind]

    @property
    def usable(self) -> int:
        return max(0, int((self.capacity - self.reserve) * (1.0 - self.fragmentation)))

    @property
    def on_gpu(self) -> bool:
        return self.kind == "gpu"


# Total memory as torch reports it (MiB figures from nvidia-smi on each card).
GPUS: dict[str, int] = {
    "h100-80gb": 81_559 * MiB,
    "h200-141gb": 143_771 * MiB,
    "a100-80gb": 81_920 * MiB,
    "a100-40gb": 40_960 * MiB,
}
DEVICE_NAMES = (*GPUS, "cpu", "auto")


def host_available() -> int:
    """MemAvailable from /proc/meminfo (bytes): what the host can still hand out without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resolve_device(name: str, ranks_on_host: int = 1, cuda_index: int | None = None) -> DeviceSpec:
    """The spec of ``name`` (see ``DEVICE_NAMES``). ``cpu``: MemAvailable split over the ranks
    that share this host. ``auto``: the current (or ``cuda_index``) CUDA device, else ``cpu``."""
    if name in GPUS:
        return DeviceSpec(name, "gpu", GPUS[name])
    if name == "auto":
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device() if cuda_index is None else cuda_index
            props = torch.cuda.get_device_properties(index)
            return DeviceSpec(f"cuda:{index} ({props.name})", "gpu", int(props.total_memory))
        name = "cpu"
    if name == "cpu":
        ranks = max(1, ranks_on_host)
        note = f"MemAvailable / {ranks} ranks on this host" if ranks > 1 else "MemAvailable"
        return DeviceSpec("cpu", "cpu", host_available() // ranks, note)
    raise ValueError(f"plan.device={name!r} is unknown; use one of {', '.join(DEVICE_NAMES)}")
