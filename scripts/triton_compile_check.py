#!/usr/bin/env python
"""Compile every Triton kernel (SCAPE's, dense AdamS's) for a Hopper GPU (sm_90) without one.

    TRITON_INTERPRET=0 .venv/bin/python scripts/triton_compile_check.py [--stage ptx|cubin]

The interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels on CPU tensors) accepts
code the compiler refuses -- e.g. arithmetic on a ``constexpr`` it cannot lower, a pointer cast
of the wrong width -- so the tests alone do not prove the kernels build for the GPU. This runs
Triton's front end and its lowering to PTX (and, with ``--stage cubin``, ptxas, which the triton
wheel carries) for every kernel and every ``constexpr`` variant the launchers use, with argument
types as the launchers pass them (sizes as i64, tensors as pointers). No GPU, no launch:
it says nothing about speed or results on the device. Exit status 1 if any variant fails.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on"):
    sys.exit("set TRITON_INTERPRET=0: the interpreter replaces the compiler")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from scape_train.optim import adams_triton as at  # noqa: E402
from scape_train.optim.scape import triton_codecs as tc  # noqa: E402
from scape_train.optim.scape import triton_passes as tp  # noqa: E402
from scape_train.optim.scape import triton_select as ts  # noqa: E402

A, P64, F64, F32, U8 = "i64", "*i64", "*fp64", "*fp32", "*u8"   # a size or offset, tensor pointers


def variants() -> list[tuple]:
    """(kernel, argument types, constexprs) for every variant the launchers use."""
    kb, fb = {"BLOCK": tp.K_BLOCK}, {"BLOCK": tp.FULL_BLOCK}
    out = []
    f32s = lambda *names: {n: F32 for n in names}     # noqa: E731
    for general, cand in ((True, False), (False, False), (False, True)):
        # over one flat gradient buffer: n and the tensors divisible by 16 (as Triton
        # specializes them at a launch); the PTX must show 16-byte accesses
        out.append((tp._prepare_kernel, dict(n=A, **f32s("g", "e", "m"), parts=F64,
                                             beta1="fp32", s="fp32", lo=A, hi=A,
                                             **f32s("rho", "cand")),
                    {"GENERAL": general, "CAND": cand, **fb},
                    {"divisible": ("n", "g", "e", "m", "parts"), "vector_loads": True}))
    for al in (False, True):      # aligned: the streams' tensors and k divisible by 16
        want = ({"vector_loads": True, "divisible": ("k", "n", "idx", "pidx", "out", "b",
                                                     "m_old", "parts")},) if al else ()
        out.append((tp._prepare_fix_kernel, dict(k=A, pidx=P64, **f32s("g", "e", "m"),
                                                 parts=F64, beta1="fp32", s="fp32"), kb, *want))
        out.append((tp._rho_kernel, dict(pidx=P64, k=A, **f32s("rho", "m"), beta1="fp32"),
                    kb, *want))
        for take in (False, True):
            out.append((tp._gather_kernel, dict(k=A, idx=P64, base=A, **f32s("src", "out"),
                                                parts=F64), {"TAKE": take, **kb}, *want))
        for has_rho, has_m in ((False, True), (True, True), (False, False)):
            out.append((tp._ghat_kernel, dict(k=A, idx=P64, base=A, **f32s("b", "rho", "m",
                                                                            "m_old"),
                                              parts=F64, nb="fp32", d="fp32"),
                        {"HAS_RHO": has_rho, "HAS_M": has_m, **kb}, *want))
        out.append((tp._fill_kernel, dict(dst=F32, idx=P64, k=A, value="fp32"), kb, *want))
        out.append((tp._mark_bits_kernel, dict(idx=P64, k=A, words="*i32"), kb, *want))
        out.append((tp._count_bits_kernel, dict(idx=P64, k=A, words="*i32", parts=P64), kb,
                    *want))
    scal = {n: "fp32" for n in ("beta1", "beta2", "omb1", "omb2", "bc1", "sqrt_bc2", "eps", "ns")}
    for clip, has_out, bias in ((True, False, 1), (False, True, 2), (True, True, 0)):
        out.append((tp._adams_kernel, dict(blocks=P64, param_table=P64, idx=P64, j0=A, base=A,
                                           **f32s("ghat", "m", "out", "m_old", "norm"),
                                           max_norm="fp32", dec="fp32", **scal),
                    {"CLIP": clip, "HAS_OUT": has_out, "BIAS": bias, **kb}))
    out.append((tp._scatter_params_kernel, dict(blocks=P64, param_table=P64, idx=P64,
                                                values=F32), kb))
    out.append((tp._decay_kernel, dict(blocks=P64, param_table=P64, dec="fp32"), fb))
    # the masks: whole-range packing and the codings
    out.append((tc._pack_kernel, dict(mask_ptr=U8, out_ptr=U8, n=A, nbytes=A),
                {"PACK_BYTES": tc.PACK_BYTES}))
    out.append((tc._unpack_kernel, dict(packed_ptr=U8, out_ptr=U8, n=A, nbytes=A),
                {"PACK_BYTES": tc.PACK_BYTES}))
    for packed in (False, True):
        out.append((tc._count_kernel, dict(src_ptr=U8, tab_ptr=P64, counts_ptr=P64),
                    {"PACKED": packed, "BLOCK": tc.BLOCK}))
    out.append((tc._encode_bitmap_kernel, dict(bits_ptr=U8, tab_ptr=P64, shard_ptr=U8),
                {"PACK_BYTES": tc.PACK_BYTES}))
    out.append((tc._encode_fields_kernel, dict(bits_ptr=U8, tab_ptr=P64, starts_ptr=P64,
                                               words_ptr="*i32"), {"BLOCK": tc.BLOCK}))
    out.append((tc._decode_scan_kernel, dict(buf_ptr=U8, buf_len=A, tab_ptr=P64, starts_ptr=P64,
                                             words_ptr="*i32", idx_ptr=P64), {"BLOCK": tc.BLOCK}))
    out.append((tc._decode_direct_kernel, dict(buf_ptr=U8, buf_len=A, tab_ptr=P64,
                                               words_ptr="*i32", idx_ptr=P64),
                {"BLOCK": tc.BLOCK}))
    # dense AdamS: whole blocks (unmasked; aligned addresses: 16-byte accesses) and tails
    dense = dict(blocks=P64, table=P64, coef=F32, **scal, dec="fp32")
    for dtype, clip, decay, bias, tail in ((tl.float32, True, True, 1, False),
                                           (tl.float32, False, False, 2, True),
                                           (tl.bfloat16, True, True, 0, False)):
        want = () if tail else ({"vector_loads": True},)
        out.append((at._adams_dense_kernel, dense,
                    {"DTYPE": dtype, "CLIP": clip, "DECAY": decay, "BIAS": bias, "TAIL": tail,
                     "ALIGNED": True, "BLOCK": at.BLOCK}, *want))
    # the next mask's top-k
    sel = dict(stat=F32, blocks=P64, segs=P64)
    nb = {"NB": ts.NB}
    out.append((ts._hist_kernel, dict(**sel, hist="*i32"), {"BLOCK": ts.BLOCK, **nb}))
    out.append((ts._pick_kernel, dict(segs=P64, hist="*i32", state=P64), nb))
    out.append((ts._split_kernel, dict(**sel, state=P64, counters=P64, bits=U8, buf_u=P64,
                                       buf_i=P64), {"BLOCK": ts.BLOCK}))
    for level, (shift, width) in enumerate(ts.LEVELS[1:], 1):
        out.append((ts._level_kernel, dict(**sel, state=P64, hist="*i32", buf_u=P64, buf_i=P64),
                    {"LEVEL": level, "SHIFT": shift, "WIDTH": width, "BLOCK": ts.BLOCK, **nb}))
    out.append((ts._mark_kernel, dict(**sel, state=P64, hist="*i32", buf_u=P64, buf_i=P64,
                                      bits=U8), {"BLOCK": ts.BLOCK, **nb}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("ptx", "cubin"), default="ptx")
    args = p.parse_args()
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for fn, sig, consts, *extra in variants():
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} {consts}"
        want = extra[0] if extra else {}
        try:
            names = list(sig)
            attrs = {(names.index(a),): [["tt.divisibility", 16]]
                     for a in want.get("divisible", ()) if a in names}
            src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                            attrs=attrs)
            kernel = triton.compile(src, target=target, options={"enable_fp_fusion": False})
            if args.stage not in kernel.asm:
                raise RuntimeError(f"no {args.stage} produced ({sorted(kernel.asm)})")
            wide = len(re.findall(r"ld\.global[.\w]*\.v(?:4\.b32|2\.b64)", kernel.asm["ptx"]))
            if want.get("vector_loads") and not wide:
                raise RuntimeError("no 16-byte global loads in the PTX (ld.global.v4.b32 or "
                                   ".v2.b64)")
            if wide:
                name += f" ({wide} 16-byte loads)"
            print(f"ok    {name}", flush=True)
        except Exception as exc:     # report every failing variant, not just the first
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    print(f"{failed} of {len(variants())} variants failed for sm_90 ({args.stage})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
