"""SCAPE's payload on the wire: fp32 (the default), or low precision with error feedback.

``optimizer.payload_dtype``: ``fp32`` | ``bf16`` | ``fp8_e4m3`` | ``fp8_e5m2`` | ``fp4_e2m1``.

Wire format of ``n`` values (:class:`PayloadCodec`; every buffer on the wire is uint8 bytes)::

    bf16        n·2 bytes (round to nearest even), no scale
    fp8_*       n bytes, then ceil(n / SCALE_BLOCK) one-byte scale exponents e_b (int8), one per
                block of SCALE_BLOCK consecutive values: value = fp8 · 2^e_b
    fp4_e2m1    ceil(n / 2) bytes (value 2i in the low 4 bits of byte i, 2i+1 in the high 4),
                then the scales as fp8's: value = fp4 · 2^e_b. A code is a sign bit and 3 bits
                of magnitude, one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (OCP MX's E2M1), rounded to
                the nearest (a tie to the smaller)

Scales are powers of two, chosen from the block's absolute maximum ``a = m·2^x`` (``frexp``,
``m ∈ [0.5, 1)``) as ``e = x - E`` with ``E = 8`` (e4m3, largest finite 448) or ``15`` (e5m2,
57344) or ``2`` (e2m1, largest 6), so every scaled value is below ``2^E`` and never overflows;
``e`` is clamped to ``[-110, 120]`` (e2m1: ``125``) so that ``2^e`` is a normal fp32 number and
nothing decodes to inf (a value within a rounding of fp32's largest, ~3.4e38, can round up to
``2^E``; e2m1 then saturates at 6, which is still within a factor 2 of it). With a power-of-two
scale the scaling is exact both ways and the only rounding is the cast to the low-precision
type; the rounded value ``d`` of ``x`` lies in ``[x/2, 2x]`` (or is 0), so by Sterbenz's lemma
``x - d`` is exact in fp32: a rank's quantization error, fed back into its residual, loses
nothing (``x = d + (x - d)`` bit for bit).

The codec is these torch ops on every device: the payload is ``k`` values (1-10% of the
parameters), a handful of ``k``-sized elementwise ops with no host read, and this module is the
wire format's one definition.

The reduction is accumulated in fp32 on every backend: nothing low-precision is ever reduced by
the backend (gloo rounds every partial bf16 sum to bf16 and refuses fp8 -- measured; NCCL adds
bf16 per hop in the ring and, before NCCL 2.24 or without sm90, has no fp8 type -- from torch's
headers, not run here). Instead (:func:`all_reduce_mean`):

    1. each rank quantizes its n·w values (n chunks of w, padded) and ALL-TO-ALLs the chunks:
       rank j receives every rank's chunk j                            (n-1)·C bytes sent
    2. rank j dequantizes them and sums in fp32, in rank order, then divides by n
    3. rank j re-quantizes its reduced chunk and the chunks are ALL-GATHERED  (n-1)·C bytes sent

with ``C`` the bytes of one coded chunk: 2(n-1)·C in all, what a ring all-reduce of the coded
payload moves. Every rank decodes the same gathered bytes, so the result is bit-identical on all
ranks. The re-quantization error of step 3 belongs to no rank's gradient: the reducing rank adds
``n·(b̄ - b̃)`` to its own residual, so that (summed over ranks) every candidate's mass is either
in ``n·b̃`` or in a residual, as in spec §2 with fp32 -- to the fp32 rounding of the sum in step 2.
The sharded engine needs only steps 1-2 (a reduce-scatter: owners keep the fp32 mean) and sends
its parameter updates with the same codec (:mod:`.sharded`).
"""

from __future__ import annotations

import torch

from scape_train.comm import Comm

PAYLOAD_DTYPES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
SCALE_BLOCK = 128      # fp8, fp4: one power-of-two scale per this many consecutive values

_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
# scaled |value| < 2^E <= the type's max
_EXP_HEADROOM = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp4_e2m1": 2}
_E_MIN = -110
_E_MAX = {"fp8_e4m3": 120, "fp8_e5m2": 120, "fp4_e2m1": 125}
# e2m1: the magnitudes of codes 0-7, and the midpoints between them (a tie rounds down)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` as exact fp32, built from the exponent bits (``e`` int32 in [-126, 127])."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


class PayloadCodec:
    """Encodes fp32 rows into wire bytes and back; ``fp32`` is the identity (raw bytes)."""

    def __init__(self, name: str):
        if name not in PAYLOAD_DTYPES:
            raise ValueError(f"payload_dtype must be one of {PAYLOAD_DTYPES}, got {name!r}")
        self.name = name
        self.lowp = name != "fp32"
        self.scaled = name.startswith(("fp8", "fp4"))
        self.fp4 = name == "fp4_e2m1"
        self.itemsize = {"fp32": 4, "bf16": 2}.get(name, 1)   # fp4: half a byte, see nbytes

    def nblocks(self, n: int) -> int:
        return -(-n // SCALE_BLOCK) if self.scaled else 0

    def nbytes(self, n: int) -> int:
        """Wire bytes of ``n`` values."""
        return (-(-n // 2) if self.fp4 else n * self.itemsize) + self.nblocks(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: fp32 ``[rows, n]`` -> uint8 ``[rows, nbytes(n)]``."""
        rows, n = x.shape
        if not self.lowp:
            return x.contiguous().view(torch.uint8).reshape(rows, 4 * n)
        if not self.scaled:
            return x.to(_TORCH_DTYPE[self.name]).view(torch.uint8).reshape(rows, 2 * n)
        nb = self.nblocks(n)
        padded = x.new_zeros(rows, nb * SCALE_BLOCK)
        padded[:, :n] = x
        blocks = padded.view(rows, nb, SCALE_BLOCK)
        amax = blocks.abs().amax(dim=2)
        _, ex = torch.frexp(amax)              # amax < 2^ex (frexp(0) gives 0)
        e = (ex - _EXP_HEADROOM[self.name]).clamp_(_E_MIN, _E_MAX[self.name])
        scaled = blocks * _pow2(-e).unsqueeze(2)
        out = torch.empty(rows, self.nbytes(n), dtype=torch.uint8, device=x.device)
        values = self.nbytes(n) - nb
        if self.fp4:
            out[:, :values] = _fp4_pack(scaled.reshape(rows, -1)[:, :n])
        else:
            q = scaled.to(_TORCH_DTYPE[self.name])
            out[:, :values] = q.view(torch.uint8).reshape(rows, -1)[:, :n]
        out[:, values:] = e.to(torch.int8).view(torch.uint8)
        return out

    def decode(self, b: torch.Tensor, n: int) -> torch.Tensor:
        """uint8 ``[rows, nbytes(n)]`` -> fp32 ``[rows, n]`` (a new tensor)."""
        rows = b.shape[0]
        if not self.lowp:
            return b.contiguous().view(torch.float32).reshape(rows, n).clone()
        if not self.scaled:
            return b.contiguous().view(_TORCH_DTYPE[self.name]).reshape(rows, n).float()
        nb = self.nblocks(n)
        values = self.nbytes(n) - nb
        vals = (_fp4_unpack(b[:, :values], n) if self.fp4
                else b[:, :n].contiguous().view(_TORCH_DTYPE[self.name]).float())
        e = b[:, values:].contiguous().view(torch.int8).to(torch.int32)
        scale = _pow2(e).unsqueeze(2).expand(rows, nb, SCALE_BLOCK).reshape(rows, -1)
        return vals.mul_(scale[:, :n])

    def round_trip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wire bytes, the values every receiver decodes) of fp32 rows ``x``."""
        b = self.encode(x)
        return b, self.decode(b, x.shape[1])


def _fp4_pack(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, n]`` (scaled: |value| < 8) -> uint8 ``[rows, ceil(n/2)]`` of e2m1 codes, two
    a byte; magnitudes of 5 and above saturate at 6."""
    rows, n = scaled.shape
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=scaled.dtype, device=scaled.device)
    code = torch.bucketize(scaled.abs(), mids).to(torch.uint8)
    code |= scaled.signbit().to(torch.uint8) << 3        # -0 keeps its sign
    pairs = scaled.new_zeros(rows, 2 * (-(-n // 2)), dtype=torch.uint8)
    pairs[:, :n] = code
    return pairs[:, 0::2] | (pairs[:, 1::2] << 4)


def _fp4_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 ``[rows, ceil(n/2)]`` -> fp32 ``[rows, n]``: the codes' values (not yet scaled)."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([table, -table])                 # codes 8-15: negative (8: -0)
    codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)[:, :n]
    return table[codes.long()]


def _chunked(x: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """``x`` (1-D) zero-padded to ``world`` rows of ``w = max(1, ceil(len/world))``."""
    w = max(1, -(-x.numel() // world))
    rows = x.new_zeros(world * w)
    rows[:x.numel()] = x
    return rows.view(world, w), w


def sum_rows_fp32(parts: torch.Tensor) -> torch.Tensor:
    """Sum of the rows of ``parts`` (fp32), added in row (rank) order: a fixed order on every
    device, so the result depends only on the values."""
    acc = parts[0].clone()
    for i in range(1, parts.shape[0]):
        acc.add_(parts[i])
    return acc


def reduce_scatter_mean(rows: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 of the module docstring. ``rows``: fp32 ``[world, w]``, row ``j`` for rank ``j``.

    Returns ``(mean, sent)``: this rank's fp32 mean of every rank's (dequantized) row ``rank``,
    and this rank's dequantized rows as the receivers decode them (``rows - sent`` is this rank's
    quantization error, exact in fp32)."""
    world, w = rows.shape
    wire, sent = codec.round_trip(rows)
    recv = torch.empty_like(wire)
    comm.all_to_all(recv, wire, kind=kind)
    mean = sum_rows_fp32(codec.decode(recv, w)).div_(world)
    return mean, sent


def all_reduce_mean(x: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-precision all-reduce (mean) of the module docstring, for 1-D fp32 ``x``.

    Returns ``(result, error)``: the dequantized mean, bit-identical on every rank, and what this
    rank must add to its residual at the same positions: its own quantization error ``x - d``
    plus, on the chunk it reduced, ``world·(mean - result)``."""
    world, rank, numel = comm.world, comm.rank, x.numel()
    rows, w = _chunked(x, world)
    mean, sent = reduce_scatter_mean(rows, comm, codec, kind=kind)
    err = rows.sub(sent)
    wire = codec.encode(mean.view(1, w))
    gathered = torch.empty(world * wire.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, wire.view(-1), kind=kind)
    result = codec.decode(gathered.view(world, -1), w)
    err[rank].add_(mean.sub_(result[rank]).mul_(world))
    return result.view(-1)[:numel], err.view(-1)[:numel]


def all_gather_mean(x: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_reduce_mean` for a group that carries no all-to-all (torchft's replica groups:
    ``Comm.offers_all_to_all``): every rank all-gathers every rank's coded ``x`` (1-D fp32),
    decodes the rows and sums them in fp32 in rank order, so the result is bit-identical on all
    ranks; (n-1)·C_x bytes sent, n/2 times the all-to-all form's. Nothing is re-quantized, so
    ``error`` is this rank's own rounding ``x - d`` alone."""
    rows = all_gather_rows(x, comm, codec, kind=kind)
    return sum_rows_fp32(rows).div_(comm.world), x - rows[comm.rank]


def quantized_mean(x: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, error)`` of 1-D fp32 ``x`` over ``comm`` through ``codec``: :func:`all_reduce_mean`,
    or :func:`all_gather_mean` where the group offers no all-to-all. Either way every rank gets
    the same mean, and the errors, summed over the ranks, are what the mean did not deliver."""
    if comm.offers_all_to_all:
        return all_reduce_mean(x, comm, codec, kind=kind)
    return all_gather_mean(x, comm, codec, kind=kind)


def all_gather_rows(shard: torch.Tensor, comm: Comm, codec: PayloadCodec, *, kind: str
                    ) -> torch.Tensor:
    """Every rank's fp32 ``shard`` (``[w]``) through the codec: ``[world, w]`` dequantized, the
    same bytes decoded the same way on every rank (the owner's own row included)."""
    w = shard.numel()
    wire = codec.encode(shard.view(1, w))
    gathered = torch.empty(comm.world * wire.numel(), dtype=torch.uint8, device=shard.device)
    comm.all_gather(gathered, wire.view(-1), kind=kind)
    return codec.decode(gathered.view(comm.world, -1), w)
