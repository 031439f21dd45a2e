"""One elastic worker as a torchft replica group: its ``Manager``, the quorum of each round, and
what it records about the quorum (who joined, who left, which rounds failed, when it healed).

    group = ReplicaGroup(cfg.strategy.elastic, run_dir, state_fn, load_fn)
    strategy = build_local_strategy(..., comm=group.comm)   # the outer rounds go through torchft
    each round:  group.begin_round()        # quorum from the lighthouse; a worker that is behind
                                            # heals here from a live peer (load_fn)
                 ... H inner steps, the outer round (its vote: group.comm.commit()) ...
                 group.end_round(loader_state, record)   # after a commit: this worker's cursor

The quorum is taken synchronously at the start of each round (``use_async_quorum=False``), so a
worker that heals does so before its inner steps and takes part in that very round. A worker is
replica group ``replica_<slot>``: torchft reads the slot back from that name to number the
quorum's members, which is how joins and leaves are named here.

Data position: slot ``s`` reads shard ``s`` of ``slots`` shards of the stream. After every
committed round the worker writes its cursor to ``<run_dir>/elastic_cursor.pt``: its loader state
and its own record (the trainer's counters: step, tokens, bytes sent, W&B run). A worker
restarted with the same run directory and slot resumes its own shard there, so the batches of
its unfinished round are read again (none skipped) and none it committed is read twice, and its
record continues rather than starting again at 0. A round that fails updates only the bytes sent
(they were sent). A new slot starts its shard at the beginning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from scape_train.comm import ReplicaComm
from scape_train.optim.local.config import ElasticConfig

log = logging.getLogger("scape_train")

CURSOR_FILE = "elastic_cursor.pt"
EVENTS_FILE = "elastic.jsonl"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def import_torchft():
    """torchft, imported only by elastic runs; a clear error where it is not installed."""
    os.environ.setdefault("RUST_LOG", "warn")     # torchft's servers log every quorum at info
    # torchft logs every quorum and vote, and a lost peer with a traceback; this package reports
    # them itself, one line each (ReplicaGroup.begin_round / end_round)
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        import torchft.manager
        import torchft.process_group
    except ImportError as exc:
        raise ImportError("strategy.elastic.enabled=true needs torchft: pip install "
                          "'scape_train[elastic]' (torchft==0.2.0)") from exc
    return torchft


def snapshot_tree(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory: what a peer fetches later must not
    change while this worker trains on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot_tree(v) for v in obj)
    return obj


def cross_group_backend(backend: str, device: torch.device) -> str:
    """The backend of the process group across replica groups (``strategy.elastic.backend``):
    ``auto`` is NCCL where this worker's device is CUDA, gloo elsewhere."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"strategy.elastic.backend=nccl needs CUDA, but this worker runs on "
                         f"{device}: use backend=gloo (or auto)")
    return backend


def _recording_group(backend: str, timeout: timedelta):
    """torchft's reconfigurable process group (gloo, or NCCL: collectives that time out abort
    the communicator instead of hanging), remembering the slots of the quorum it was last
    configured for (torchft passes them as ``global_ranks``)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo

    class Recording(base):
        members: list[int] = []

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):
            self.members = sorted(global_ranks or [])
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)

    return Recording(timeout=timeout)


class ReplicaGroup:
    """This worker's torchft ``Manager`` (replica group of one process) and its quorum log;
    ``device``: where the worker's tensors live, the exchange's included."""

    def __init__(self, cfg: ElasticConfig, run_dir: Path, state_fn: Callable[[], dict],
                 load_fn: Callable[[dict], None], device: torch.device | str = "cpu"):
        import_torchft()
        from torch.distributed import TCPStore
        from torchft.manager import Manager

        lighthouse = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ValueError("strategy.elastic.lighthouse is empty and $TORCHFT_LIGHTHOUSE is "
                             "unset: start one with `python -m scape_train.elastic lighthouse` "
                             "and pass its address, e.g. strategy.elastic.lighthouse="
                             "http://localhost:29510")
        self.cfg, self.run_dir, self.slot = cfg, Path(run_dir), cfg.replica
        device = torch.device(device)
        self.backend = cross_group_backend(cfg.backend, device)
        self._load_fn = load_fn
        host = socket.gethostname()
        # this replica group's own store: torchft's managed group meets in the store of the
        # quorum's first member, so it must be reachable by the other workers
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pg = _recording_group(self.backend, timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._heal, state_dict=lambda: snapshot_tree(state_fn()),
            min_replica_size=cfg.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s), rank=0, world_size=1,
            store_addr=host, store_port=self.store.port, lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.slot}", hostname=host, quorum_retries=cfg.quorum_retries)
        self.comm = ReplicaComm(self.manager, self.pg, device)
        log.info("elastic: replica %d exchanges its %s tensors across replica groups over "
                 "backend %s", self.slot, device, self.backend)
        self.members: list[int] = []
        self.joined: list[tuple[int, int]] = []     # (round, slot) a worker joined at
        self.left: list[tuple[int, int]] = []       # (round, slot) a worker left at
        self.heals: list[int] = []                  # rounds this worker healed at
        self.failed_rounds: list[int] = []          # rounds whose vote failed here
        self.quorum_s = 0.0                         # time spent waiting for quorums
        self._healed_now = False
        self._cursor: dict | None = None            # as last written to CURSOR_FILE
        self._events = open(self.run_dir / EVENTS_FILE, "a")
        # Fault injection for tests (docs/reliability.md), off unless set:
        # SCAPE_FAULT_KILL_AT_VOTE=R SIGKILLs this worker in round R after its exchange, before
        # its vote (the others finished the exchange with it: a death at the round itself).
        # SCAPE_FAULT_FREEZE_AT_EXCHANGE=R stops this worker (SIGSTOP) in round R after its quorum,
        # as its exchange starts: its peers' exchange of that round waits for it until the timeout.
        kill_at = os.environ.get("SCAPE_FAULT_KILL_AT_VOTE", "")
        self.comm.kill_at_vote = int(kill_at) if kill_at.strip() else None
        freeze_at = os.environ.get("SCAPE_FAULT_FREEZE_AT_EXCHANGE", "")
        self.comm.freeze_at_exchange = int(freeze_at) if freeze_at.strip() else None

    # -- the round ---------------------------------------------------------------------------
    def _heal(self, state: dict) -> None:
        self._healed_now = True
        self._load_fn(state)

    def begin_round(self) -> list[str]:
        """The quorum of the next round (blocks until the lighthouse forms it; a worker behind
        the others heals here). Returns what changed, as log lines."""
        start = time.perf_counter()
        self._healed_now = False
        if not self.comm.quorum_started:
            self._write({"slot": self.slot, "first_quorum_request": True})
        self.manager.start_quorum()
        self.comm.took_quorum()
        self.quorum_s += time.perf_counter() - start
        t = self.manager.current_step()
        now = list(self.pg.members) or [self.slot]
        joined = sorted(set(now) - set(self.members)) if self.members else []
        left = sorted(set(self.members) - set(now))
        self.joined += [(t, s) for s in joined]
        self.left += [(t, s) for s in left]
        self.members = now
        lines = []
        if joined or left:
            lines.append(f"elastic: round {t}: quorum {now} ({len(now)} workers)"
                         + (f", joined {joined}" if joined else "") + (f", left {left}" if left else ""))
        if self._healed_now:
            self.heals.append(t)
            lines.append(f"elastic: replica {self.slot} healed from a live peer at round {t}")
        return lines

    def end_round(self, loader_state: dict, record: dict) -> None:
        """After the outer round: record its outcome; after a commit, keep the cursor (the data
        position and the trainer's ``record``, whose ``sent_bytes`` a failed round updates)."""
        committed = bool(self.comm.last_vote)
        t = self.manager.current_step()
        if committed:
            self._cursor = {"slot": self.slot, "round": t, "loader": loader_state, "record": record}
        else:
            self.failed_rounds.append(t)
            error = self.comm.last_error
            cause = str(getattr(error, "original_exception", error)).splitlines()[0] if error \
                else "another participant's exchange failed"
            log.warning("elastic: round %d did not commit (%s); this worker keeps its parameters "
                        "and its drift joins the next round", t, cause)
            if self._cursor is not None and "record" in self._cursor:
                self._cursor["record"] = {**self._cursor["record"], "sent_bytes": record["sent_bytes"]}
        if self._cursor is not None:
            path = self.run_dir / CURSOR_FILE
            torch.save(self._cursor, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        self._write({"slot": self.slot, "round": t, "step": record["step"],
               "committed": committed, "quorum": self.members, "healed": self._healed_now,
               "batches": loader_state["counters"]["batches"]})

    def _write(self, row: dict) -> None:
        """One line of ``elastic.jsonl`` (every life of this worker appends to it)."""
        self._events.write(json.dumps({"time": time.time(), "pid": os.getpid(), **row}) + "\n")
        self._events.flush()

    def resume_cursor(self, loader) -> dict | None:
        """Load this slot's data position of its last committed round, if it has a cursor; returns
        the trainer's record saved with it (``None`` without a cursor, or one written before
        cursors held it)."""
        path = self.run_dir / CURSOR_FILE
        if not path.exists():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved["slot"] != self.slot:
            raise ValueError(f"{path} holds the data cursor of slot {saved['slot']}, but this "
                             f"worker is slot {self.slot}: give each worker its own run_dir")
        loader.load_state_dict(saved["loader"])
        self._cursor = saved
        self._write({"slot": self.slot, "resumed_round": saved["round"],
                     "resumed_batches": saved["loader"]["counters"]["batches"]})
        log.info("elastic: slot %d resumes its data shard where it last committed (round %d)",
                 self.slot, saved["round"])
        return saved.get("record")

    # -- what users see ----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {"elastic/quorum": float(len(self.members)), "elastic/joins": float(len(self.joined)),
                "elastic/leaves": float(len(self.left)), "elastic/heals": float(len(self.heals)),
                "elastic/failed_rounds": float(len(self.failed_rounds)),
                "elastic/quorum_wait_s": self.quorum_s}

    def summary(self) -> dict[str, Any]:
        """The faults this worker survived."""
        return {"slot": self.slot, "committed_rounds": self.manager.current_step(),
                "quorum": self.members, "joined": self.joined, "left": self.left,
                "healed_at": self.heals, "failed_rounds": self.failed_rounds}

    def close(self) -> None:
        self._events.close()
        self.manager.shutdown(wait=False)
