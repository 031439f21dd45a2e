"""The optimizer's typed config (Hydra group ``optimizer``). One schema for every optimizer so
experiments switch with ``optimizer=scape`` and unknown keys still fail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class OptimizerConfig:
    name: str = "adamw"               # adamw | adams | scape | topk_adamw | powersgd
    lr: float = 1e-3                  # peak lr; the trainer's schedule scales it
    min_lr: float = 1e-4              # lr at the end of the cosine / wsd decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam (beta1, beta2)
    eps: float = 1e-8                 # Adam denominator epsilon (scape needs > 0)
    weight_decay: float = 0.1         # decoupled weight decay
    clip_grad: float = 1.0            # 0 = off
    bias_correction: str = "adam"     # AdamS: adam | official | none
    foreach: bool = True              # torch's multi-tensor (foreach) kernels
    # SCAPE / top-k
    density: float = 0.1              # fraction communicated (0.01 = 99% sparsity)
    density_warmup_steps: int = 0     # warm-up from 1.0 to density; 0 = constant
    density_schedule: str = "geometric"   # warm-up shape: geometric | linear | constant
    density_start_step: int = 0       # steps before it: dense data-parallel AdamS (density 1)
    density_cooldown_steps: int = 0   # the last C steps: geometric back to 1 (flushes residuals)
    mask_hysteresis: float = 0.0      # scape, ours (opt-in): next-mask statistic |c|·(1+γ) on M_t
    partitioner: str = "tensor"       # tensor | flat
    sharded: bool = False             # ZeRO-1 state (spec section 3)
    exclude_norm_bias: bool = True    # scape/top-k: 1-D tensors (biases, norm gains) travel dense
    offload_residuals: bool = False   # scape: per-rank residuals in host memory
    offload_chunk_numel: int = 1 << 22  # offload: elements per double-buffered copy
    use_triton: str = "auto"          # auto | on | off
    mask_coding: str = "auto"         # auto (smallest per segment) | bitmap | indices | elias_fano
    scape_impl: str = "fused"          # scape: fused (O(k) local step) | reference (spec line by line)
    payload_dtype: str = "fp32"       # fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | fp4_e2m1 (error feedback)
    flat_grads: bool = True           # p.grad are views of one flat buffer (scape) or of DDP's buckets (dense, world > 1); off: autograd's
    # PowerSGD baseline
    powersgd_rank: int = 4            # PowerSGD baseline: rank of the low-rank approximation
    powersgd_start_iter: int = 10     # PowerSGD: dense steps before compression (>= 2)
