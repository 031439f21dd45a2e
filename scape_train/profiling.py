"""Counting what a step asks of the device: host syncs and kernel launches, on any backend.

A host sync is an operation whose result the host must wait for: reading a value (``.item()``,
``float(t)``, ``.tolist()``, ``if t:``) or an op whose *output size* depends on the data
(``nonzero``, ``masked_select``, boolean indexing, ``unique``...), which on CUDA reads the size
back before it can allocate. On the CPU none of these stall anything, which is why they go
unnoticed until the first GPU run; counted at the dispatcher, they are visible on the CPU too, and
a test can hold a step to a budget that NCCL training needs (see ``tests/test_nccl_rules.py``).

A copy from host memory to the device stalls the host too, unless it is asynchronous from pinned
memory. Two sites count: ``h2d_copy``, a copy from the host to a device that is blocking or reads
pageable memory, and ``host_data``, a tensor built from Python or NumPy data (``torch.tensor``,
``as_tensor``, ``from_numpy``: ``aten.lift_fresh``). On a GPU path such a tensor is either copied
to the device (a blocking copy) or read on the host; on the CPU, where ``.to(device)`` is no copy
at all, it is the only trace such a copy leaves. Tables meant for the host or for an asynchronous
upload are built under :func:`host_tables` (``scape_train.host_to_device``) and counted apart, as
``host_tables``.

A kernel launch is counted as one dispatched ATen operator that computes (views, aliases and
allocations are free); on CUDA each is at least one kernel, so the count compares code paths
honestly even where it is not the exact kernel count.

    with DeviceOpCounter() as ops:
        strategy.step(lr)
    ops.host_syncs, ops.launches, ops.sync_sites   # counts, and which ops synced (name: count)
    ops.bytes_moved                                # bytes read + written by the computing ops

``bytes_moved`` is the memory traffic the dispatched ops ask for, counted per op as the nbytes of
its tensor inputs plus its outputs (an in-place op's ``self`` is read and written; ``out=`` and
``fill_``/``zero_``/``copy_`` targets are written only), and for the index ops
(``index_select``, ``index_copy_``, ``index_fill_``, ``index_add_``, ``gather``, ``scatter_``,
``index``, ``index_put_``) only the touched elements and the index. It ignores caches and
fusion: a model of DRAM traffic for unfused kernels, a code-path comparison, not a measurement.
SCAPE's Triton kernels never reach the dispatcher: they report their own bytes (``add_kernel``;
a Triton launch also counts as one launch, in ``kernel_bytes``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that always make the host wait: reading a value, or an output size that depends on data.
_SYNC_OPS = {
    aten._local_scalar_dense.default,          # .item(), float(t), int(t), bool(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
# Ops that sync only with some arguments: a boolean index (``x[mask]``, ``x[mask] = v``).
_BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
# Host reads that never reach the dispatcher (they read the storage directly).
_SYNC_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}

# Ops that compute nothing: no kernel.
_FREE_OPS = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.lift_fresh.default, aten.detach.default, aten.alias.default,
    aten._local_scalar_dense.default,
}


_HOST_TABLES = threading.local()
# DeviceOpCounters in effect: Triton launchers report to them (they never reach the dispatcher)
active_counters: list = []


@contextlib.contextmanager
def host_tables():
    """Tensors built from host data in here are host tables, or uploaded asynchronously from
    pinned memory (``scape_train.host_to_device``), and values read in here are of host memory
    an asynchronous copy filled and an event made current (``scape_train.step_flags``): not a
    stall, counted as ``host_tables``."""
    depth = getattr(_HOST_TABLES, "depth", 0)
    _HOST_TABLES.depth = depth + 1
    try:
        yield
    finally:
        _HOST_TABLES.depth = depth


def _is_blocking_h2d(func, args, kwargs) -> bool:
    """A copy from the host to a device that makes the host wait: blocking, or from pageable
    memory (which the driver stages, and may synchronize the stream to do)."""
    if func is aten._to_copy.default:
        dst, src = kwargs.get("device"), args[0]
        if dst is None or torch.device(dst).type == "cpu" or src.device.type != "cpu":
            return False
    elif func is aten.copy_.default:
        src = args[1]
        if args[0].device.type == "cpu" or src.device.type != "cpu":
            return False
    else:
        return False
    return not (kwargs.get("non_blocking") or (len(args) > 2 and args[2])) \
        or not src.is_pinned()


def _caller() -> str:
    """The innermost frame outside torch and this module: where a counted op was asked for."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("/profiling.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _in_torch_optim() -> bool:
    """torch's own optimizers keep ``state['step']`` as a host tensor (unless capturable or
    fused) and read it with ``.item()``: a host read, not a device sync, though on the CPU the two
    look alike. Such reads are counted apart, as ``host_scalar_reads``."""
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/optim/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def _is_d2h_copy(func, args, kwargs) -> bool:
    """A copy from a device to the host (``.cpu()``, ``.to('cpu')``) waits for the device."""
    if func is aten._to_copy.default:
        dst = kwargs.get("device")
        return (dst is not None and torch.device(dst).type == "cpu"
                and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu")
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


# written only: the target of a fill or copy, the result of a ``new_*`` factory (``self`` gives
# the dtype and device, it is not read)
_WRITE_ONLY = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "new_zeros",
               "new_ones", "new_empty", "new_full"}
_INDEX_READ = {"index_select", "gather", "index"}             # output-sized reads of self
_INDEX_WRITE = {"index_copy_", "index_add_", "scatter_", "index_put_"}  # source-sized writes


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nb(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes read + written by one dispatched op (see the module docstring)."""
    name = func.overloadpacket.__name__
    outs = list(_tensors(out))
    if name in _INDEX_READ:
        idx = [t for t in _tensors(args[1:]) if t.dtype in (torch.int64, torch.int32, torch.bool)]
        return _nb(idx) + 2 * _nb(outs)
    if name in _INDEX_WRITE:
        rest = list(_tensors(args[1:]))
        return 2 * _nb(rest) - _nb([t for t in rest if t.dtype in (torch.int64, torch.int32)])
    if name == "index_fill_":
        idx = args[2]
        return idx.numel() * args[0].element_size() + _nb([idx])
    if name in _WRITE_ONLY:
        return _nb(list(_tensors(args[1:]))) + _nb(outs)
    ins = list(_tensors(args)) + list(_tensors([v for k, v in kwargs.items() if k != "out"]))
    if not outs and name.endswith("_") and args:     # in-place foreach ops return nothing
        outs = list(_tensors(args[0]))
    return _nb(ins) + _nb(outs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "DeviceOpCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if (func in _SYNC_OPS or (func in _BOOL_INDEX_OPS and _has_bool_index(args))
                or _is_d2h_copy(func, args, kwargs)):
            if func is aten._local_scalar_dense.default and _in_torch_optim():
                o.host_scalar_reads += 1
            else:
                o.sync(str(func.overloadpacket.__name__))
        elif func is aten.lift_fresh.default:
            if getattr(_HOST_TABLES, "depth", 0):
                o.host_tables += 1
            elif _in_torch_optim():     # its host step counters (see _in_torch_optim)
                o.host_scalar_reads += 1
            else:
                o.sync("host_data")
        elif _is_blocking_h2d(func, args, kwargs):
            o.sync("h2d_copy")
        if func not in _FREE_OPS and not func.is_view and func.namespace == "aten":
            o.launches += 1
            o.ops[str(func.overloadpacket.__name__)] += 1
            out = func(*args, **kwargs)
            o.bytes_moved += op_bytes(func, args, kwargs, out)
            return out
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: "DeviceOpCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_METHODS:
            if getattr(_HOST_TABLES, "depth", 0):   # host memory a waited event made current
                self.owner.host_tables += 1
            else:
                self.owner.sync(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class DeviceOpCounter:
    """Context manager counting host syncs and launches of the code run inside it."""

    def __init__(self, trace: bool = False):
        self.sync_sites: Counter = Counter()
        self.trace = trace
        self.sync_lines: Counter = Counter()    # with ``trace``: "file:line site" -> count
        self.ops: Counter = Counter()
        self.launches = 0
        self.host_scalar_reads = 0
        self.host_tables = 0        # tensors built from host data under ``host_tables()``
        self.bytes_moved = 0
        self.kernel_bytes: Counter = Counter()     # Triton kernels: name -> bytes

    def sync(self, site: str) -> None:
        self.sync_sites[site] += 1
        if self.trace:
            self.sync_lines[f"{_caller()} {site}"] += 1

    @property
    def host_syncs(self) -> int:
        return sum(self.sync_sites.values())

    def __enter__(self) -> "DeviceOpCounter":
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        active_counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        active_counters.remove(self)
        for m in reversed(self._modes):
            m.__exit__(*exc)

    def add_kernel(self, name: str, nbytes: int) -> None:
        """A Triton kernel (``optim/scape/counted_launch``): one launch, its bytes read and
        written, computed by the launcher from the kernel's arguments."""
        self.launches += 1
        self.ops[f"triton::{name}"] += 1
        self.kernel_bytes[name] += nbytes
        self.bytes_moved += nbytes


def held_tensors(*roots, max_depth: int = 8) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through attributes, lists, tuples and dicts (not
    into ``nn.Module`` s): what an optimizer holds between steps, pools and caches included."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if depth > max_depth or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for v in vars(obj).values():
                walk(v, depth + 1)

    for root in roots:
        walk(root, 0)
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.device.type != "meta"}
    return sum(storages.values())
