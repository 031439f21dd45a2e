"""The fused step's Triton passes (``triton_passes.py``), run here under ``TRITON_INTERPRET=1``
(tests/conftest.py) through the seam the engine uses (``strategy.select_passes``; ``use_triton=on`` picks them
on CPU tensors), against the engine's torch ops: masks exactly, parameters, momentum and
residuals to the fused step's tolerance (tests/test_scape_fused.py: the kernels round division
and square root correctly, where torch's vectorized ``sqrt`` may be 1 ulp off, and add their
float64 sums in another order). The Triton path must also keep NCCL's rule: nothing read back to
the host after step 1.
"""

from __future__ import annotations

import pytest
import torch

from scape_train.optim.config import OptimizerConfig
from scape_train.optim.scape.strategy import select_passes
from scape_train.profiling import DeviceOpCounter

from ._dist import run_distributed
from ._optim_common import batch, flat_params, loss_fn, make, train_step


def _cfg(use_triton: str, **kw) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, density=0.2, density_schedule="geometric",
                density_warmup_steps=2, clip_grad=0.05)
    base.update(kw)
    return OptimizerConfig(**base, use_triton=use_triton)


def _run(cfg: OptimizerConfig, rank: int, steps: int) -> dict:
    s, w, _ = make(cfg)
    metrics = [train_step(s, w, t, rank) for t in range(1, steps + 1)]
    state = {k: v.clone() for k, v in s.reference.full_state().items()}
    out = dict(p=flat_params(w), state=state, mask=s.mask_cur.clone(), metrics=metrics,
               fast=(s.last_engine is s.fused))
    s.close()
    return out


def _triton_vs_torch(rank: int, steps: int = 5, **kw) -> tuple[dict, dict]:
    return _run(_cfg("on", **kw), rank, steps), _run(_cfg("off", **kw), rank, steps)


def _assert_same(tri: dict, ref: dict) -> None:
    assert tri["fast"] and ref["fast"]
    assert torch.equal(tri["mask"], ref["mask"])
    for a, b in [(tri["p"], ref["p"])] + [(tri["state"][k], v) for k, v in ref["state"].items()]:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()) + 1e-12)
    for mt, mr in zip(tri["metrics"], ref["metrics"]):
        for k in ("grad_norm", "scape/residual_norm", "scape/payload_numel"):
            assert mt[k] == pytest.approx(mr[k], rel=1e-5, abs=1e-12), k
        assert mt.get("scape/mask_overlap") == mr.get("scape/mask_overlap")   # count_common


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("bias_correction", ["adam", "official", "none"])
def test_triton_passes_equal_the_torch_ops(sharded, bias_correction):
    _assert_same(*_triton_vs_torch(0, sharded=sharded, bias_correction=bias_correction))

@pytest.mark.parametrize("sharded", [False, True])
def test_the_passes_ran_and_were_counted(sharded):
    from scape_train.profiling import DeviceOpCounter

    with DeviceOpCounter() as ops:
        _run(_cfg("on", sharded=sharded, density_warmup_steps=0), 0, 3)
    assert ops.ops.get("triton::adams", 0) >= 2 and ops.kernel_bytes["adams"] > 0, dict(ops.ops)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("flat_grads", [True, False])
def test_the_prepare_kernel_reads_the_flat_buffer_per_tensor_grads_take_torch(flat_grads, sharded, monkeypatch):
    """The flat gradient buffer takes the prepare kernel (aligned, 16-byte accesses on a GPU);
    autograd's own per-tensor gradients take the torch passes; both equal the torch ops."""
    from scape_train.optim.scape import triton_passes

    launched = []
    real = triton_passes.run

    def spy(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(triton_passes, "run", spy)
    _assert_same(*_triton_vs_torch(0, sharded=sharded, flat_grads=flat_grads))
    assert (launched.count("_prepare_kernel") > 0) == flat_grads, launched


def _dist_worker(rank, world, sharded, partitioner):
    return _triton_vs_torch(rank, steps=4, sharded=sharded, partitioner=partitioner)


@pytest.mark.dist
@pytest.mark.parametrize("world,sharded,partitioner", [
    pytest.param(3, True, "flat", marks=pytest.mark.slow), (2, False, "tensor")])
def test_triton_passes_equal_the_torch_ops_distributed(world, sharded, partitioner):
    for tri, ref in run_distributed(_dist_worker, world, (sharded, partitioner)):
        _assert_same(tri, ref)


def _sync_worker(rank, world, sharded):
    # the static-shape path CUDA runs around the passes
    s, w, _ = make(_cfg("on", sharded=sharded, density_warmup_steps=0),
                   width=64)
    out = []
    for t in range(1, 5):
        x, y = batch(t, rank)
        loss_fn(w, x, y).backward()
        with DeviceOpCounter() as ops:
            s.step(1e-3)
        s.zero_grad()
        out.append((dict(ops.sync_sites), dict(ops.ops)))
    s.close()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_triton_passes_read_nothing_back_to_the_host(sharded):
    for steps in run_distributed(_sync_worker, 2, (sharded,)):
        for syncs, calls in steps[1:]:
            assert syncs == {}
            assert calls.get("triton::adams", 0) >= 1     # the passes ran, and were counted
            # m's support known from step 2 on: the support prepare, the payload's gather
            prepare, payload = ("prepare_sharded", "take") if sharded else ("prepare", "gather")
            assert calls.get(f"triton::{prepare}", 0) == 1, calls
            assert calls.get(f"triton::{payload}", 0) >= 1, calls


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_sm90(tmp_path):
    """The interpreter accepts code the compiler refuses: every kernel and constexpr variant
    goes through Triton's lowering to PTX for sm_90 (no GPU needed, none launched)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "triton_compile_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), "--stage", "ptx"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r"^0 of \d+ variants failed", proc.stdout, re.M), proc.stdout[-2000:]


@pytest.mark.parametrize("k", [1024, 2500])
def test_k_sized_passes_over_whole_blocks_and_a_tail(k):
    """The k-sized passes launch the whole blocks and the tail block apart (aligned 16-byte
    streams on a GPU): each equals its torch ops at sizes with and without a tail, on views at
    an offset too (an unaligned stream takes the scalar variant)."""
    lib = select_passes("on", torch.device("cpu"))
    gen = torch.Generator().manual_seed(k)
    n = 4 * k + 7
    for start in (0, 1):                         # idx[1:]: not 16-byte aligned
        idx = torch.randperm(n, generator=gen)[:k + start].sort().values
        at = idx[start:]
        s = torch.randn(n, generator=gen)
        m = torch.randn(n, generator=torch.Generator().manual_seed(1))
        s0, vals, m_old = s.clone(), torch.empty(k + start), torch.empty(k + start)
        v = vals[start:]
        sq = lib.gather(at, s, v)
        assert torch.equal(v, s0[at])
        assert float(sq) == pytest.approx(float(s0[at].double().square().sum()), rel=1e-12)
        want = (v + m[at] * -0.9) / 0.1
        sq = lib.ghat(v, m_old[start:], 0.9, idx=at, m=m)
        assert torch.equal(m_old[start:], m[at])    # the old m at the mask, stored
        torch.testing.assert_close(v, want, rtol=1e-6, atol=0)
        assert float(sq) == pytest.approx(float(v.double().square().sum()), rel=1e-12)
        sq = lib.take(at, s, v)
        assert torch.equal(v, s0[at]) and not s[at].any()
        assert torch.equal(s[s != 0], s0[s != 0])
        zero = torch.nonzero(s == 0).view(-1)
        bits = torch.empty(16 * (n // 128 + 1), dtype=torch.uint8)   # scratch, zeroed
        # every taken position is zero now: found among the zeros
        assert int(lib.count_common(at, zero, bits)) == k


def test_a_steady_step_launches_as_many_kernels_whatever_the_number_of_tensors():
    """The Triton path's steady step (replicated, one rank): its launches do not grow with the
    tensors (the top-k selects every segment at once), at most 40, none reading back."""
    from scape_train.models import build_model
    from scape_train.models.config import ModelConfig
    from scape_train.optim import build_optimizer
    from scape_train.optim.grad_buffer import write_grads
    from scape_train.profiling import DeviceOpCounter

    counted = []
    for layers in (1, 3):
        cfg = ModelConfig(name="t", arch="llama", n_layers=layers, d_model=32, n_heads=4,
                          n_kv_heads=2, ffn_dim=64, max_seq_len=16, vocab_size=128,
                          tie_embeddings=False)
        torch.manual_seed(0)
        model = build_model(cfg, device=torch.device("cpu"))
        params = list(model.parameters())
        s = build_optimizer(OptimizerConfig(name="scape", density=0.05, use_triton="on",
                                            clip_grad=1.0), model)
        for t in range(4):
            gen = torch.Generator().manual_seed(t)
            write_grads(params, (torch.randn(p.shape, generator=gen) for p in params),
                        s.grad_buffer)
            if t < 3:
                s.step(1e-3)
        with DeviceOpCounter() as ops:
            s.step(1e-3)
        s.close()
        assert ops.host_syncs == 0, ops.sync_sites
        counted.append((len(params), ops.launches))
    (n1, l1), (n3, l3) = counted
    assert n3 > n1 and l1 == l3 <= 40, counted


@pytest.mark.parametrize("sharded", [False, True])
def test_steady_steps_at_new_learning_rates_launch_alike_and_upload_nothing(sharded):
    """The Triton path's steady step at a learning rate it has not seen (a schedule moves it
    every step): the same launches with the same bytes as the step before, no table built
    from host data, no host read; the segments and their device tables are built once per
    mask plan."""
    from scape_train.models import build_model
    from scape_train.models.config import ModelConfig
    from scape_train.optim import build_optimizer
    from scape_train.optim.grad_buffer import write_grads
    from scape_train.profiling import DeviceOpCounter

    cfg = ModelConfig(name="t", arch="llama", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
                      ffn_dim=64, max_seq_len=16, vocab_size=128, tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg, device=torch.device("cpu"))
    params = list(model.parameters())
    s = build_optimizer(OptimizerConfig(name="scape", density=0.05, use_triton="on",
                                        clip_grad=1.0, sharded=sharded), model)
    counted = []
    for t in range(5):
        gen = torch.Generator().manual_seed(t)
        write_grads(params, (torch.randn(p.shape, generator=gen) for p in params),
                    s.grad_buffer)
        with DeviceOpCounter() as ops:
            s.step(1e-3 * (1 + t))
        counted.append(ops)
    s.close()
    for ops in counted[3:]:
        assert ops.host_syncs == 0, ops.sync_sites
        assert ops.host_tables == 0, ops.ops
    a, b = counted[3], counted[4]
    assert a.ops == b.ops and a.kernel_bytes == b.kernel_bytes, (a.ops - b.ops, b.ops - a.ops)
