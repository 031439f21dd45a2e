"""Run a function on several real processes joined by a gloo process group (CPU).

    results = run_distributed(fn, world_size=3, args=(...))

``fn(rank, world_size, *args)`` runs in each process after ``init_process_group("gloo")``; its
return value (anything picklable, tensors included) comes back in rank order. An exception in any
rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from scape_train.optim.comm import enforce_comm_only_from_env

    enforce_comm_only_from_env()     # spawned: conftest did not run here
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:  # report every failure to the parent, then re-raise
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args: tuple = ()) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        try:
            mp.start_processes(_worker, args=(world_size, port, fn, args, out_dir),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:
            errors = []
            for r in range(world_size):
                path = os.path.join(out_dir, f"rank{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"--- rank {r} ---\n{rec['error']}")
            raise RuntimeError("distributed test failed:\n" + "\n".join(errors)) from exc
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)["result"]
                for r in range(world_size)]
