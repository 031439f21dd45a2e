"""Triton kernels for SCAPE's low-precision payload (:class:`.payload.PayloadCodec`, whose
wire format they write and read bit for bit): the CUDA path, tested under ``TRITON_INTERPRET=1``.

Every conversion is integer arithmetic on the fp32 bits (int32 views in and out), so it is exact
whatever the hardware's conversion, rounding or flush-to-zero modes, and the interpreter, which
has no fp8 and little bf16 support, runs the same code:

- fp32 -> bf16 / fp8: c10's algorithms (torch's ``.to(dtype)`` on every device): round to
  nearest even, subnormals included; e4m3fn saturates to 448 (it has no inf), e5m2 overflows to
  inf; NaN -> 0x7F (fp8) and, as torch's CPU conversion gives it, 0xFFFF (bf16).
- fp8 -> fp32: exact; a NaN keeps its payload, quieted (as torch on the CPU).
- the scale ``2^-e`` (``2^e`` on decode): exponent arithmetic, with IEEE round-to-nearest-even
  where the product is subnormal -- what torch's fp32 multiply gives, with no flush to zero.
- the block exponent: ``frexp`` of the block's largest magnitude, found as the largest int of
  the magnitudes' bits (non-negative floats sort as their bits; NaN above inf, as torch's
  ``amax`` propagates it); 0 for 0, inf and NaN, as ``torch.frexp``.

Sizes come from the shapes: nothing is read back to the host. One program covers SCALE_GROUPS
blocks of SCALE_BLOCK values of one row (fp8) or BLOCK values (bf16); every grid is one
dimension (CUDA's x, up to 2^31 - 1 programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counted_launch import launch
from .payload_format import E_MAX as _E_MAX, E_MIN as _E_MIN, EXP_HEADROOM as _EXP_HEADROOM
from .payload_format import SCALE_BLOCK

BLOCK = 4096
SCALE_GROUPS = 32          # fp8 scale blocks per program (4096 values)
NUM_WARPS = 8

# fp8 formats: mantissa bits, exponent bias, whether it saturates (e4m3fn: no inf)
_FP8 = {"fp8_e4m3": dict(MBITS=3, BIAS=7, SATURATE=True),
        "fp8_e5m2": dict(MBITS=2, BIAS=15, SATURATE=False)}
E_MIN, E_MAX = tl.constexpr(_E_MIN), tl.constexpr(_E_MAX)


# ----------------------------------------------------------------------------------------------
# integer helpers on fp32 bits (int32)


@triton.jit
def _bit_length(v):
    """Bits of ``v`` (int32, >= 0) up to its leading one: 0 for 0."""
    n = tl.zeros_like(v)
    for i in tl.static_range(5):            # steps of 16, 8, 4, 2, 1 (as powers: a constexpr
        big = (v >> 2 ** (4 - i)) != 0      # has no __rrshift__, and is assigned only once)
        n += tl.where(big, 2 ** (4 - i), 0)
        v = tl.where(big, v >> 2 ** (4 - i), v)
    return n + (v != 0).to(tl.int32)


@triton.jit
def _shift_round_even(v, s):
    """``v / 2^s`` rounded to nearest, ties to even (``v`` int32 >= 0, ``1 <= s <= 30``)."""
    q = v >> s
    rem = v - (q << s)
    half = 1 << (s - 1)
    return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)


@triton.jit
def _mul_pow2(bits, k):
    """fp32 bits of ``x * 2^k`` (``k`` int32), as an IEEE multiply rounds it: exact unless the
    product is subnormal (then to nearest even); 0 and inf unchanged, NaN quieted."""
    mag = bits & 0x7FFFFFFF
    eb = mag >> 23
    frac = mag & 0x7FFFFF
    sub = eb == 0
    lead = tl.where(sub, 24 - _bit_length(frac), 0)        # puts a subnormal's leading one
    mant = tl.where(sub, frac << lead, frac | 0x800000)     # at bit 23
    ey = tl.where(sub, 1 - lead, eb) + k
    normal = tl.where(ey >= 255, 0x7F800000, (ey << 23) | (mant & 0x7FFFFF))
    tiny = _shift_round_even(mant, tl.minimum(tl.maximum(1 - ey, 1), 25))  # a carry: normal
    out = tl.where(ey >= 1, normal, tiny)
    special = tl.where(frac != 0, mag | 0x400000, mag)      # inf; NaN, quieted
    out = tl.where(eb == 255, special, tl.where(mag == 0, 0, out))
    return out | ((bits >> 31) << 31)


@triton.jit
def _fp32_to_fp8(bits, MBITS: tl.constexpr, BIAS: tl.constexpr, SATURATE: tl.constexpr):
    """c10's ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``: the code (int32)."""
    mag = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MBITS
    # normal: the exponent rebased and the mantissa rounded (a carry rolls into the exponent)
    odd = (mag >> drop) & 1
    normal = (mag + ((BIAS - 127) << 23) + (2 ** (drop - 1) - 1) + odd) >> drop
    if SATURATE:
        normal = tl.where(normal == 0x7F, 0x7E, normal)     # not into NaN: to 448
    # below the smallest normal: a count of the smallest subnormal, 2^(1 - BIAS - MBITS)
    eb = mag >> 23
    mant = tl.where(eb > 0, (mag & 0x7FFFFF) | 0x800000, mag)
    shift = (151 - BIAS - MBITS) - tl.maximum(eb, 1)
    small = _shift_round_even(mant, tl.minimum(tl.maximum(shift, 1), 25))
    q = tl.where(mag < ((128 - BIAS) << 23), small, normal)
    # at or past the first value that does not round to the largest finite one
    top: tl.constexpr = (1087 << 20) if SATURATE else (143 << 23)   # 480, 65536
    over: tl.constexpr = 0x7E if SATURATE else 0x7C                  # 448, inf
    q = tl.where(mag >= top, tl.where(mag > 0x7F800000, 0x7F, over), q)
    return q | ((bits >> 24) & 0x80)


@triton.jit
def _fp8_to_fp32(code, MBITS: tl.constexpr, BIAS: tl.constexpr, SATURATE: tl.constexpr):
    """The fp32 bits of fp8 ``code`` (int32 0..255): exact; NaN quieted, payload kept."""
    ebits: tl.constexpr = 7 - MBITS
    ef = (code >> MBITS) & (2 ** ebits - 1)
    m = code & (2 ** MBITS - 1)
    normal = ((ef + (127 - BIAS)) << 23) | (m << (23 - MBITS))
    bl = _bit_length(m)
    sub = ((bl + (127 - BIAS - MBITS)) << 23) | ((m << (24 - bl)) & 0x7FFFFF)  # m·2^(1-B-M)
    out = tl.where(ef > 0, normal, tl.where(m > 0, sub, 0))
    if SATURATE:
        special = (code & 0x7F) == 0x7F                     # e4m3fn: NaN only
    else:
        special = ef == 2 ** ebits - 1                      # e5m2: inf and NaN
    nan_or_inf = tl.where(m == 0, 0x7F800000, 0x7FC00000 | (m << (23 - MBITS)))
    out = tl.where(special, nan_or_inf, out)
    return out | ((code & 0x80) << 24)


@triton.jit
def _fp32_to_bf16(bits):
    """c10's round to nearest even (an overflow rounds to inf); NaN -> 0xFFFF (torch's CPU)."""
    mag = bits & 0x7FFFFFFF
    r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    return tl.where(mag > 0x7F800000, 0xFFFF, r | ((bits >> 16) & 0x8000))


@triton.jit
def _scale_exponent(amax, HEADROOM: tl.constexpr):
    """``e`` of a block from its largest magnitude's bits: frexp's exponent (0 for 0, inf and
    NaN, as torch.frexp) less the headroom, clamped to [E_MIN, E_MAX]."""
    eb = amax >> 23
    x = tl.where(eb > 0, eb - 126, _bit_length(amax) - 149)
    x = tl.where((amax == 0) | (eb == 255), 0, x)
    return tl.minimum(tl.maximum(x - HEADROOM, E_MIN), E_MAX)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _bf16_encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _fp32_to_bf16(bits).to(tl.int16), mask=offs < n)


@triton.jit
def _bf16_decode_kernel(h_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(h_ptr + offs, mask=offs < n).to(tl.int32) & 0xFFFF
    tl.store(out_ptr + offs, h << 16, mask=offs < n)


@triton.jit
def _fp8_tile(n, nblocks, tiles, GROUPS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """This program's row, its blocks (of the row) and their values' columns: program
    ``row * tiles + tile`` (:func:`fp8_grid`)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // tiles
    blk = (pid - row * tiles) * GROUPS + tl.arange(0, GROUPS)
    col = blk[:, None] * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)[None, :]
    return row, blk, blk < nblocks, col, col < n


@triton.jit
def _fp8_encode_kernel(x_ptr, out_ptr, n, nblocks, tiles, row_bytes, MBITS: tl.constexpr,
                       BIAS: tl.constexpr, SATURATE: tl.constexpr, HEADROOM: tl.constexpr,
                       GROUPS: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    row, blk, blk_in, col, inside = _fp8_tile(n, nblocks, tiles, GROUPS, SCALE_BLOCK)
    bits = tl.load(x_ptr + row * n + col, mask=inside, other=0)      # padding: zeros
    e = _scale_exponent(tl.max(bits & 0x7FFFFFFF, axis=1), HEADROOM)
    q = _fp32_to_fp8(_mul_pow2(bits, -e[:, None]), MBITS, BIAS, SATURATE)
    out = out_ptr + row * row_bytes
    tl.store(out + col, q.to(tl.uint8), mask=inside)
    tl.store(out + n + blk, (e & 0xFF).to(tl.uint8), mask=blk_in)     # int8, two's complement


@triton.jit
def _fp8_decode_kernel(b_ptr, out_ptr, n, nblocks, tiles, row_stride, MBITS: tl.constexpr,
                       BIAS: tl.constexpr, SATURATE: tl.constexpr, GROUPS: tl.constexpr,
                       SCALE_BLOCK: tl.constexpr):
    row, blk, blk_in, col, inside = _fp8_tile(n, nblocks, tiles, GROUPS, SCALE_BLOCK)
    src = b_ptr + row * row_stride
    code = tl.load(src + col, mask=inside, other=0).to(tl.int32)
    e = tl.load(src + n + blk, mask=blk_in, other=0).to(tl.int32)
    e = e - ((e & 0x80) << 1)                                         # int8 from its byte
    out = _mul_pow2(_fp8_to_fp32(code, MBITS, BIAS, SATURATE), e[:, None])
    tl.store(out_ptr + row * n + col, out, mask=inside)


# ----------------------------------------------------------------------------------------------
# launchers (called by PayloadCodec: shapes and names already checked there)


def fp8_grid(rows: int, n: int) -> tuple[tuple[int], int]:
    """The fp8 kernels' launch grid over ``rows`` rows of ``n`` values, and the programs per row.

    One dimension, ``rows * tiles`` programs: CUDA's grid x reaches 2^31 - 1 while y and z stop
    at 65,535, which a second dimension of tiles would pass at a row of ~268M values (world
    size 1, a large k)."""
    tiles = triton.cdiv(triton.cdiv(n, SCALE_BLOCK), SCALE_GROUPS)
    return (rows * tiles,), tiles


def _rows_bytes(b: torch.Tensor) -> torch.Tensor:
    """``b`` with unit column stride (rows may be strided: a view of a gathered buffer)."""
    return b if b.stride(1) == 1 else b.contiguous()


def encode(x: torch.Tensor, name: str, nbytes: int) -> torch.Tensor:
    """fp32 ``[rows, n]`` -> uint8 ``[rows, nbytes]``, as ``PayloadCodec.encode``."""
    rows, n = x.shape
    bits = x.contiguous().view(torch.int32)
    out = torch.empty(rows, nbytes, dtype=torch.uint8, device=x.device)
    if rows * n == 0:
        return out
    if name == "bf16":
        launch(_bf16_encode_kernel, (triton.cdiv(rows * n, BLOCK),), "payload_encode_bf16",
               6 * rows * n, bits, out.view(torch.int16), rows * n, BLOCK=BLOCK,
               num_warps=NUM_WARPS)
        return out
    nb = triton.cdiv(n, SCALE_BLOCK)
    grid, tiles = fp8_grid(rows, n)
    # 4 B read and 1 B written per value, 1 B per block's exponent
    launch(_fp8_encode_kernel, grid, f"payload_encode_{name}",
           rows * (5 * n + nb), bits, out, n, nb, tiles, nbytes, **_FP8[name],
           HEADROOM=_EXP_HEADROOM[name], GROUPS=SCALE_GROUPS, SCALE_BLOCK=SCALE_BLOCK,
           num_warps=NUM_WARPS)
    return out


def decode(b: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """uint8 ``[rows, nbytes(n)]`` -> fp32 ``[rows, n]``, as ``PayloadCodec.decode``."""
    rows = b.shape[0]
    out = torch.empty(rows, n, dtype=torch.int32, device=b.device)
    if rows * n == 0:
        return out.view(torch.float32)
    if name == "bf16":
        h = b.contiguous().view(torch.int16)
        launch(_bf16_decode_kernel, (triton.cdiv(rows * n, BLOCK),), "payload_decode_bf16",
               6 * rows * n, h, out, rows * n, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return out.view(torch.float32)
    b = _rows_bytes(b)
    nb = triton.cdiv(n, SCALE_BLOCK)
    grid, tiles = fp8_grid(rows, n)
    # 1 B read and 4 B written per value, 1 B per block's exponent
    launch(_fp8_decode_kernel, grid, f"payload_decode_{name}",
           rows * (5 * n + nb), b, out, n, nb, tiles, b.stride(0), **_FP8[name],
           GROUPS=SCALE_GROUPS, SCALE_BLOCK=SCALE_BLOCK, num_warps=NUM_WARPS)
    return out.view(torch.float32)
