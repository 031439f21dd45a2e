"""Run a function on several real processes joined by a gloo process group (CPU).

    results = run_distributed(fn, world_size=3, args=(...))

``fn(rank, world_size, *args)`` runs in each process after ``init_process_group("gloo")``; its
return value (anything picklable, tensors included) comes back in rank order. An exception in any
rank fails the caller with that rank's traceback.

The ranks are started by a forkserver that has imported torch, torch.distributed, omegaconf and
hydra once: each rank is a fresh process forked from it, so a run pays seconds less than a spawn
that imports torch per rank. They are as separate as spawned ones (own memory, own gloo group,
the package imported anew in each); each takes the caller's environment and working directory as
they are at the call (a forked rank would otherwise hold the forkserver's, from its start) before
it unpickles ``fn`` and ``args``, and writes its stdout and stderr to the caller's file
descriptors 1 and 2 as they are then (pytest's ``capfd`` sees the ranks' output, as a spawned
rank's inherited descriptors gave it). Nothing of the package is preloaded: what the package (or
a library it imports) reads from the environment at import, it reads from the caller's.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
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


# Third-party only: nothing here reads an environment variable a test sets.
_PRELOAD = ["torch", "torch.distributed", "omegaconf", "hydra"]


class _CallerFd:
    """A file descriptor of the caller, sent to the rank (SCM_RIGHTS) when it is started."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the rank starts: the fd goes with the start request
        from multiprocessing import reduction

        return (_CallerFd._received, (reduction.DupFd(self.fd),))

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _worker(rank, world_size, port, payload, out_dir, environ, cwd, out_fds):
    for target, fd in zip((1, 2), out_fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from scape_train.comm import enforce_comm_only_from_env

    enforce_comm_only_from_env()     # a new process: conftest did not run here
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        fn, args = pickle.loads(payload)  # imports the test's module, and so the package, only now
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
        multiprocessing.set_forkserver_preload(_PRELOAD)  # used when the server starts: once
        try:
            mp.start_processes(_worker, args=(world_size, port, pickle.dumps((fn, args)), out_dir,
                                              dict(os.environ), os.getcwd(),
                                              (_CallerFd(1), _CallerFd(2))),
                               nprocs=world_size, join=True, start_method="forkserver")
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
