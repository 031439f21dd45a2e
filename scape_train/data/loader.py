"""The per-rank training loader: documents -> tokens -> packed blocks, in a background thread.

Keeping ahead of the GPU: with ``data.num_workers`` = N > 1 the documents are tokenized by N-1
worker processes (:mod:`.encode_worker`), chunks of ``CHUNK_DOCS`` documents submitted ahead and
consumed in order; the background thread only reads records, packs and stacks. With
``pin_memory`` (the trainer sets it on CUDA) the thread also leaves each batch's inputs and
targets in pinned host memory, so the trainer's copy to the device is queued without a staging
copy and the training loop's thread does no per-batch work beyond taking it from the queue.

Exactness: the producer attaches to every batch the state *after* that batch (document cursor,
the packer's pending tokens, counters). ``__next__`` keeps the state of the batch it returns, so
``state_dict()`` describes exactly the batches the trainer has received, however far the
background thread has read ahead. Loading a state restarts the producer from it.

World size: the state records rank and world size; loading it on another world size raises a
ValueError (documents are split across ranks by world size, so another split would repeat or skip
data). The micro-batch size may change: the state is kept in blocks, not batches.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from itertools import islice
from typing import Iterator, Optional

import numpy as np
import torch

from scape_train.data import encode_worker
from scape_train.data.config import DataConfig
from scape_train.data.packing import Packer
from scape_train.data.sources import Cursor, DocStream, iter_val_texts, train_stream
from scape_train.data.tokenizer import Tokenizer
from scape_train.profiling import host_tables

log = logging.getLogger(__name__)

STATE_VERSION = 1
CHUNK_DOCS = 64          # documents per encode_batch call


def _encode_pool(tok: Tokenizer, workers: int) -> Optional[Executor]:
    """``workers`` tokenizer processes (threads for a tokenizer without a Rust backend), or
    ``None`` for none. Processes start by ``spawn``: the trainer's process holds CUDA state and
    threads, which a forked child must not inherit."""
    if workers < 1:
        return None
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # a spawned process re-running an unguarded script: its own pool's worker could never
        # start, and the half-started process would keep the parent's pool waiting forever
        raise RuntimeError("data.num_workers > 1 starts tokenizer processes with 'spawn', which "
                           "imports the main script again: put the script's code that builds "
                           "the loader under `if __name__ == '__main__':` (or set "
                           "data.num_workers=1)")
    if tok.spec is None:
        return ThreadPoolExecutor(workers, thread_name_prefix="scape-tokenize")
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=encode_worker.init, initargs=(tok.spec,))


def _tokenized_chunks(docs: Iterator, tok: Tokenizer, pool: Optional[Executor], depth: int):
    """(records, token ids of the good ones) in stream order; with a pool, `depth` chunks ahead."""
    def chunks():
        while True:
            items = list(islice(docs, CHUNK_DOCS))
            if not items:
                return
            yield items, [t for t, _, _ in items if t is not None]

    if pool is None:
        for items, texts in chunks():
            yield items, tok.encode_batch(texts)
        return
    encode = tok.encode_batch if isinstance(pool, ThreadPoolExecutor) else encode_worker.encode
    pending: deque = deque()
    for items, texts in chunks():
        pending.append((items, pool.submit(encode, texts)))
        if len(pending) > depth:
            items0, fut = pending.popleft()
            yield items0, fut.result()
    while pending:
        items0, fut = pending.popleft()
        yield items0, fut.result()


def _produce(stream: DocStream, tok: Tokenizer, state: dict, micro_batch: int, block_len: int,
             pool: Optional[Executor], depth: int) -> Iterator[tuple[np.ndarray, dict]]:
    """Endless (batch [micro_batch, block_len], state after the batch) from ``state``."""
    cursor = Cursor(**state["cursor"])
    packer = Packer(block_len, tok.eos_id)
    packer.load_state_dict(state["packer"])
    counters = dict(state["counters"])
    blocks: list[np.ndarray] = []

    def emit():
        nonlocal blocks
        while packer.has_block():
            blocks.append(packer.pop())
            if len(blocks) == micro_batch:
                batch, blocks = np.stack(blocks), []
                counters["batches"] += 1
                yield batch, {"cursor": cursor.to_dict(), "packer": packer.state_dict(),
                              "counters": dict(counters)}

    yield from emit()      # a restored packer may already hold whole blocks
    for items, token_lists in _tokenized_chunks(stream.iter_docs(cursor), tok, pool, depth):
        ids_iter = iter(token_lists)
        for text, reason, after in items:
            if text is None:
                counters["skipped_records"] += 1
                counters[f"skipped/{reason}"] = counters.get(f"skipped/{reason}", 0) + 1
            else:
                ids = next(ids_iter)
                packer.add(ids)
                counters["docs"] += 1
                counters["tokens"] += len(ids) + 1
            cursor = after
            counters["epoch"] = after.epoch
            yield from emit()


def _inputs_and_targets(batch: np.ndarray, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [B, seq_len + 1] -> (inputs, targets) [B, seq_len] each, in pinned memory if ``pin``.
    The split is numpy's single-threaded copy, not torch's: from the loader's thread a torch copy
    would take the intra-op thread pool the training loop's own CPU ops use."""
    x, y = np.ascontiguousarray(batch[:, :-1]), np.ascontiguousarray(batch[:, 1:])
    with host_tables():     # host data the trainer uploads asynchronously (host_to_device)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


class TrainLoader:
    """Iterator of (inputs, targets), LongTensor [micro_batch_size, seq_len] each, for one rank.
    ``pin_memory``: batches in pinned host memory (needs CUDA), for asynchronous copies."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, pin_memory: bool = False):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.cfg, self.tok = cfg, tokenizer
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.pin_memory = pin_memory
        self.block_len = cfg.seq_len + 1
        self._stream = train_stream(cfg, rank, world_size)     # fails fast on a bad path / no hub
        self._state = {"cursor": Cursor().to_dict(), "packer": Packer(self.block_len, 0).state_dict(),
                       "counters": {"docs": 0, "tokens": 0, "skipped_records": 0, "batches": 0,
                                    "epoch": 0}}
        self._gen: Optional[Iterator] = None
        self._thread: Optional[threading.Thread] = None
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._pool: Optional[Executor] = None
        self._wait_s = 0.0

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> "TrainLoader":
        return self

    def _start(self) -> None:
        workers = self.cfg.num_workers
        if workers > 1 and self._pool is None:
            self._pool = _encode_pool(self.tok, workers - 1)
        # two chunks in flight per tokenizer: each worker has the next one queued
        gen = _produce(self._stream, self.tok, self._state, self.micro_batch_size, self.block_len,
                       self._pool, depth=max(1, 2 * (workers - 1)))
        if workers == 0:
            self._gen = gen
            return
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=max(1, self.cfg.prefetch))
        self._thread = threading.Thread(target=self._run,
                                        args=(gen, self._queue, self._stop, self.pin_memory),
                                        name=f"scape-data-rank{self.rank}", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(gen: Iterator, q: queue.Queue, stop: threading.Event, pin: bool) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False
        try:
            for batch, state in gen:
                if not put((_inputs_and_targets(batch, pin), state)):
                    return
        except BaseException as e:  # handed to the trainer's thread, which re-raises it
            put(e)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gen is None and self._thread is None:
            self._start()
        if self._gen is not None:
            batch, state = next(self._gen)
            xy = _inputs_and_targets(batch, self.pin_memory)
        else:
            t0 = time.perf_counter()
            item = self._queue.get()
            self._wait_s += time.perf_counter() - t0
            if isinstance(item, BaseException):
                self._stop_worker()
                raise item
            xy, state = item
        self._state = state
        return xy

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        s = self._state
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size,
                "seq_len": self.cfg.seq_len, "tokenizer": self.tok.fingerprint,
                "cursor": dict(s["cursor"]), "packer": {"tokens": s["packer"]["tokens"].clone()},
                "counters": dict(s["counters"])}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')} != {STATE_VERSION}")
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(
                f"data loader state was saved by rank {state['rank']} of world size "
                f"{state['world_size']}, but is loaded by rank {self.rank} of {self.world_size}: "
                "resuming the data stream on another world size is not supported (the documents "
                "are split across ranks by world size). Resume with the same number of ranks.")
        if state["tokenizer"] != self.tok.fingerprint:
            raise ValueError(
                f"data loader state was made with another tokenizer (fingerprint {state['tokenizer']}, "
                f"now {self.tok.fingerprint}): resume with the same data.tokenizer settings")
        self._stop_worker()
        self._state = {"cursor": dict(state["cursor"]),
                       "packer": {"tokens": state["packer"]["tokens"].clone()},
                       "counters": dict(state["counters"])}

    def metrics(self) -> dict[str, float]:
        c = self._state["counters"]
        out = {f"data/{k}": float(v) for k, v in c.items()}
        out["data/wait_s"] = self._wait_s
        if self._queue is not None:
            out["data/queue"] = float(self._queue.qsize())
        return out

    # ------------------------------------------------------------ shutdown
    def _stop_worker(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread, self._queue, self._gen = None, None, None

    def close(self) -> None:
        self._stop_worker()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def build_train_loader(cfg: DataConfig, tokenizer: Tokenizer, micro_batch_size: int, rank: int = 0,
                       world_size: int = 1, pin_memory: bool = False) -> TrainLoader:
    return TrainLoader(cfg, tokenizer, micro_batch_size, rank, world_size, pin_memory)


def build_val_batches(cfg: DataConfig, tokenizer: Tokenizer, micro_batch_size: int, rank: int = 0,
                      world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: the first val_tokens // seq_len blocks of the validation documents
    (same order for everyone), cut into world_size contiguous parts; this rank's part in
    micro-batches (the last may be smaller, and parts differ by at most one block, so average the
    loss over tokens across ranks). A rank may get no batch when blocks < world_size."""
    n_blocks = max(1, cfg.val_tokens // cfg.seq_len)
    packer, blocks = Packer(cfg.seq_len + 1, tokenizer.eos_id), []
    texts = iter_val_texts(cfg)
    while len(blocks) < n_blocks:
        chunk = list(islice(texts, CHUNK_DOCS))
        if not chunk:
            break
        for ids in tokenizer.encode_batch(chunk):
            packer.add(ids)
            while packer.has_block() and len(blocks) < n_blocks:
                blocks.append(packer.pop().copy())
    if not blocks:
        raise ValueError(f"the validation documents hold fewer than seq_len+1={cfg.seq_len + 1} tokens")
    if len(blocks) < n_blocks:
        log.warning("validation data holds %d tokens, fewer than data.val_tokens=%d; using all of it",
                    len(blocks) * cfg.seq_len, cfg.val_tokens)
    lo, hi = len(blocks) * rank // world_size, len(blocks) * (rank + 1) // world_size
    if hi == lo:
        return []
    mine = torch.from_numpy(np.stack(blocks[lo:hi]))
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in mine.split(micro_batch_size)]
