"""SCAPE's C loops for the CPU (``scape_cpu.c``), compiled on first use and cached.

:func:`lib` returns the loaded library, or ``None`` where it cannot be used; callers then take
the torch path, which is also the reference the C loops are tested against. What decides:

- the tensors are on the CPU and ``kernels.host_reads_ok`` holds (the NCCL-rule tests and the
  memory plan's fake-tensor trace switch it off: they run the static-size torch path);
- ``SCAPE_NATIVE`` is not ``0`` (``SCAPE_NATIVE=0`` rules the C path out, e.g. to compare);
- a C compiler (``$CC``, else ``cc``/``gcc``) builds the file: the build takes about a second
  (no torch headers), is cached under ``$SCAPE_NATIVE_CACHE`` (default
  ``~/.cache/scape_train/native``) by the source's hash, and is written atomically, so ranks
  starting together do not race. A failed build warns once and the torch path runs.

The loops are called through ``ctypes`` on the tensors' raw pointers; ctypes drops the GIL for
the call, so a background collective keeps progressing. The callers check contiguity and dtype.
The loops take a thread count last; the wrapper (:class:`_Counted`) passes torch's intra-op
count, so callers call them as the Triton twins, without one. What they write, and the sums
they return, are the same for any count (``scape_cpu.c``; set ``torch.set_num_threads`` to
choose it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("scape_cpu.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd",
          "-std=c99", "-pthread"]
_ENV = "SCAPE_NATIVE"
_state: dict = {}

_P, _I, _F, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
_SIGNATURES = {
    "scape_mask_decode": (_I, [_I, _P, _P, _I, _P, _I, _P, _I, ctypes.c_int]),
    "scape_mask_encode": (_I, [_I, _P, _P, _P, _I, ctypes.c_int]),
    "scape_prepare_replicated": (_D, [_I, _P, _P, _P, _P, _P, _I, _P, _I, _F, _F, ctypes.c_int]),
    "scape_prepare_replicated_general": (_D, [_I, _P, _P, _P, _P, _F, _F, ctypes.c_int]),
    "scape_prepare_sharded": (_D, [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _F, _F,
                                   ctypes.c_int]),
    "scape_prepare_gather": (_D, [_I, _P, _P, _P, _P, _I, _P, _I, _P, _P, _F, _F,
                                  ctypes.c_int]),
    "scape_prepare_take": (_D, [_I, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P, _I, _P,
                                _I, _I, _P, _P, _F, _F, ctypes.c_int]),
    "scape_gather": (_D, [_I, _P, _I, _P, _P, ctypes.c_int]),
    "scape_take": (_D, [_I, _P, _P, _P, ctypes.c_int]),
    "scape_ghat": (_D, [_I, _P, _I, _P, _P, _P, _P, _F, _F, ctypes.c_int]),
    "scape_adams": (None, [_P, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I, _P, _P, _F,
                           ctypes.c_int, _F, _F, _F, _F, _F, _F, _F, _F, ctypes.c_int,
                           ctypes.c_int]),
    "scape_count_common": (_I, [_P, _I, _P, _I, _P, _I, ctypes.c_int]),
    "scape_scatter_params": (None, [_P, _P, _I, _P, ctypes.c_int]),
    "scape_topk_bits": (_I, [_P, _I, _I, _P, _I, _I, _P, _P, _I, ctypes.c_int]),
}


# What each loop reads and writes, in bytes, from its arguments (the counters of
# ``profiling.DeviceOpCounter`` see no torch op for a C call): the benchmarks' bytes-per-parameter
# figure counts the C path like the dispatched ops, by the elements each loop touches.
def _i64s(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address)) if n else []


def _col_sum(tab: int, rows: int, width: int, col: int) -> int:
    return sum(_i64s(tab, rows * width)[col::width])


def bits_bytes(total: int) -> int:
    """Bytes of a decoded mask's packed bits (``scape_mask_decode``'s ``packed``): ``ceil(total
    / 8)`` padded to whole 16-byte words (the Triton kernels' int32 view, aligned loads)."""
    return 16 * -(-total // 128)


ONE_BITS = 0x3F800000       # 1.0f: a parameter-table row's decay column for "no decay"


def _decayed(tab: int, rows: int, width: int, col: int) -> int:
    """Elements a parameter table's rows decay: their ranges ``[s0, s1)`` (columns ``col``,
    ``col + 1``) where the decay column (the next one) is not 1."""
    vals = _i64s(tab, rows * width)
    return sum(vals[q + col + 1] - vals[q + col] for q in range(0, len(vals), width)
               if vals[q + col + 2] != ONE_BITS)


_TRAFFIC = {
    # the packed bitmap zeroed and 1 B per one written (none when NULL), the indices (8 B per
    # one), the gathered bytes read
    "scape_mask_decode": lambda nseg, tab, buf, n, packed, total, idx, cap:
        (bits_bytes(total) + cap if packed is not None else 0) + 8 * cap + n,
    # the owner's bits read, its shard written
    "scape_mask_encode": lambda nseg, tab, bits, shard, n: _col_sum(tab, nseg, 8, 2) + n,
    # g, e read, e written per element; at m's support idx, m, g, e read, e written
    "scape_prepare_replicated": lambda nt, gtab, numels, e, m, pidx, kp, *_:
        12 * sum(_i64s(numels, nt)) + 24 * kp,
    "scape_prepare_replicated_general": lambda nt, gtab, numels, *_: 16 * sum(_i64s(numels, nt)),
    # ... and on the own range ρ read, the candidate written; at m's support idx, m, ρ
    "scape_prepare_sharded": lambda nt, gtab, numels, e, rho, m, pidx, kp, lo, hi, *_:
        12 * sum(_i64s(numels, nt)) + 8 * (hi - lo) + 16 * kp,
    # as the separate passes: the prepare, the payload and m gathered at M_t, m zeroed at its
    # old support (the C loop reads g, e and m at the mask positions from cache, in one walk)
    "scape_prepare_gather": lambda total, g, e, m, pidx, kp, idx, k, *_:
        12 * total + 24 * kp + 24 * k + 12 * kp,
    # as the separate passes: the sharded prepare, the rows taken (idx, x read, the row and x
    # written), the owner's m and ρ gathered and ρ zeroed, m zeroed at its old support
    "scape_prepare_take": lambda total, g, x, rho, m, pidx, kp, lo, hi, cand, idx, k, rows,
        nrows, send, own_a, own_b, *_: 12 * total + 8 * (hi - lo) + 16 * kp + 20 * k
        + 24 * (own_b - own_a) + 12 * kp,
    "scape_gather": lambda k, *_: 16 * k,
    "scape_take": lambda k, *_: 20 * k,     # idx, src read, values and src written
    # the payload read, ĝ written; idx and m read (or the old m at the mask read from mc,
    # where it was gathered); ρ read and zeroed; the old m at the mask written
    "scape_ghat": lambda k, idx, base, b, rho, m, mc, *_: k * (
        8 + (8 if m is not None or rho is not None else 0) + (4 if m is not None else 0)
        + (8 if rho is not None else 0) + (4 if mc is not None else 0)),
    # idx, ĝ and the old m read, θ read and written, m written; m zeroed at its old support (all
    # of m when unknown); the weight decay over the segments' other elements (θ read and
    # written; counted as its own stream: the C loop folds it into the θ walk)
    "scape_adams": lambda idx, j0, k, base, ghat, m, mlen, z, kz, ttab, nseg, out, *_:
        28 * k + (4 * mlen if kz < 0 else 12 * kz)
        + (0 if out is not None else 8 * _decayed(ttab, nseg, 7, 4)),
    # the scratch bitmap zeroed, b's indices read and their bytes written (unless b is NULL:
    # the bits given), a's read and their bytes read
    "scape_count_common": lambda a, na, b, nb, bits, nbytes:
        (nbytes + 9 * nb if b is not None else 0) + 9 * na,
    "scape_scatter_params": lambda idx, stab, nseg, v:
        16 * (_col_sum(stab, nseg, 8, 3) - _col_sum(stab, nseg, 8, 2))
        + 8 * _decayed(stab, nseg, 8, 5),
    # the sample, two passes over |c| (bits written in the second), the candidates
    "scape_topk_bits": lambda c, n, k, smp, ssize, rank, bits, work, cap: 12 * ssize
        + 9 * n + 8 * k,
}
counters: list = []          # DeviceOpCounters in effect (profiling.py registers them)


class _Counted:
    """The loaded library, each call counted by the active ``DeviceOpCounter`` s."""

    def __init__(self, cdll):
        self._cdll = cdll
        # True for the Triton twin (triton_passes): sums are device tensors, coef is one
        self.on_device = bool(getattr(cdll, "on_device", False))
        # the C loops' last argument: the host threads to run on (torch's count, per call)
        self._threads = (lambda: (torch.get_num_threads(),)) if not self.on_device else tuple

    def __getattr__(self, name: str):
        fn, traffic = getattr(self._cdll, name), _TRAFFIC[name]

        def call(*args):
            if counters:
                nbytes = traffic(*args)
                for c in counters:   # a C loop, or a Triton pass (one launch per call)
                    (c.add_kernel if self.on_device else c.add_native)(name, nbytes)
            return fn(*args, *self._threads())

        setattr(self, name, call)
        return call


def counted(passes) -> _Counted:
    """``passes`` (a library with scape_cpu.c's functions) with its calls counted."""
    return _Counted(passes)


def _cache_dir() -> Path:
    env = os.environ.get("SCAPE_NATIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "scape_train" / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build() -> ctypes.CDLL | None:
    if sys.byteorder != "little":
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"scape_cpu_{key}.so"
    if not out.exists():
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler found (set $CC, or install gcc)")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:2000]}")
            os.replace(tmp, out)           # atomic: a rank never loads a half-written file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    assert set(_TRAFFIC) == set(_SIGNATURES)
    return _Counted(lib)


def enabled() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def lib(*tensors: torch.Tensor) -> "_Counted | None":
    """The C library when it may run on ``tensors`` (all on the CPU), else ``None``."""
    from ..kernels import host_reads_ok

    if not enabled() or not all(host_reads_ok(t) for t in tensors):
        return None
    if "lib" not in _state:
        try:
            _state["lib"] = _build()
        except Exception as exc:      # no compiler, a read-only home, ...: the torch path runs
            warnings.warn(f"SCAPE's C loops are unavailable ({exc}); the torch path runs "
                          f"instead (set {_ENV}=0 to silence this)", RuntimeWarning)
            _state["lib"] = None
    return _state["lib"]


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C call (``None`` -> NULL); it must be contiguous."""
    if t is None:
        return None
    assert t.is_contiguous(), "C loops take contiguous tensors"
    return t.data_ptr()


def table(rows: list[list[int]], width: int) -> torch.Tensor:
    """An int64 table of ``width`` columns (kept alive by the caller across the call)."""
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, width) if rows else \
        torch.zeros(0, width, dtype=torch.int64)


class BufferPool:
    """Reusable CPU output tensors for a step's large temporaries. On the CPU a fresh block over
    32 MB is mmapped anew at each allocation, a page fault per 4 KB -- for a 50 MB mask more
    than the C loop that fills it. ``get`` returns a pooled group that nothing references any
    more (no other Python name, no view of its storage), else a new one (pooled while there is
    room): the caller gets a tensor it may overwrite, whoever kept an older one keeps it."""

    def __init__(self, size: int):
        self.size = size
        self._groups: list[tuple[torch.Tensor, ...]] = []

    def get(self, *specs: tuple[tuple[int, ...], torch.dtype],
            device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        if device is not None and device.type != "cpu":   # the caching allocator reuses blocks
            return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
        for group in self._groups:
            if (len(group) == len(specs)
                    and all(t.shape == shape and t.dtype == dtype
                            for t, (shape, dtype) in zip(group, specs))
                    and not any(_held_elsewhere(group, i) for i in range(len(group)))):
                return group
        group = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
        if len(self._groups) < self.size:
            self._groups.append(group)
        return group


def _held_elsewhere(group: tuple, i: int) -> bool:
    """Whether ``group[i]`` is referenced beyond the tuple: by another Python name (the tuple's
    slot and the call's argument make 2) or by a view of its storage (one tensor, plus the
    temporary storage object, make 2)."""
    return (sys.getrefcount(group[i]) > 2
            or torch._C._storage_Use_Count(group[i].untyped_storage()._cdata) > 2)
