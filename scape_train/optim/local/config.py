"""Local-step strategies' typed config (Hydra group ``strategy``); see docs/gasloc.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

ELASTIC_BACKENDS = ("auto", "gloo", "nccl")
OUTER_PAYLOAD_CHUNK = 1 << 24   # values per quantized outer all-reduce: <0.5 GB of temporaries


@dataclass
class ElasticConfig:
    """DiLoCo / GASLoC / SparseLoCo across torchft replica groups (``pip install .[elastic]``); off by default.

    Each worker is one process and one replica group with its own torchft ``Manager``; a
    lighthouse (``python -m scape_train.elastic lighthouse``) decides which workers take part in
    each round. See docs/gasloc.md (the commit rule) and docs/reliability.md (the faults)."""
    enabled: bool = False             # each worker a torchft replica group (pip install .[elastic])
    lighthouse: str = ""              # http://HOST:PORT of the lighthouse ("" = $TORCHFT_LIGHTHOUSE)
    replica: int = -1                 # this worker's slot in [0, slots): its name and data shard
    slots: int = 0                    # data shards (the most workers a run may have at once)
    min_replicas: int = 1             # a round commits only with at least this many workers
    timeout_s: float = 30.0           # a collective or the commit vote; a frozen peer is cut here
    quorum_timeout_s: float = 300.0   # waiting for the lighthouse's quorum at a round's start
    connect_timeout_s: float = 10.0   # connecting to the lighthouse and the managers
    quorum_retries: int = 30          # quorum attempts while the lighthouse is away (restarts)
    # the process group across replica groups: auto = torchft's NCCL group where the worker's
    # device is CUDA, its gloo group elsewhere; gloo also carries CUDA tensors (through host
    # memory), for links NCCL cannot use
    backend: str = "auto"             # auto | gloo | nccl


@dataclass
class StrategyConfig:
    # data_parallel: the optimizer group's own communication every step (DDP, SCAPE, ...)
    # diloco | gasloc: local inner steps with the optimizer group's optimizer, then an exchange
    name: str = "data_parallel"
    topology: str = "complete"        # gasloc: complete | 1peer | 2peer
    inner_steps: int = 30             # H; a round counts as H steps for the trainer (progress)
    inner_steps_per_worker: List[int] = field(default_factory=list)  # per-rank H_i (overrides H)
    round_budget_s: float = 0.0       # > 0: rounds bounded by wall-clock; slow workers take fewer steps
    outer_lr: float = 0.7             # eta
    outer_momentum: float = 0.9       # mu (DiLoCo) / gamma (GASLoC)
    outer_state_on_cpu: bool = False  # keep the outer optimizer's state in host memory
    mix_momentum: bool = True         # ablation: False mixes y and adds the momentum term after
    # tau: the round's exchange runs behind this many inner steps of the next round, then lands
    # (Streaming DiLoCo's overlap, torchft's fragment_sync_delay); 0 = the exchange blocks
    overlap_steps: int = 0
    # where an overlapped round lands: mix = theta <- alpha theta + (1 - alpha) theta_outer;
    # carry = theta moves by what the outer step moved the round's end point (the tau steps kept)
    overlap_merge: str = "mix"
    # alpha of overlap_merge=mix (0: the tau steps are dropped, as torchft does; Streaming DiLoCo)
    overlap_local_weight: float = 0.0
    # sparseloco: the top sparse_topk |e| of every sparse_chunk values of the error feedback e
    # (e <- sparse_error_decay * e + drift) are all-gathered, as sparse_payload_dtype values
    sparse_chunk: int = 4096          # sparseloco: values per chunk of the flat parameters (<= 32768)
    sparse_topk: int = 64             # sparseloco: values sent per chunk (64 / 4096 = 1.6%)
    sparse_error_decay: float = 0.95  # sparseloco: beta of e <- beta * e + drift, each round
    sparse_payload_dtype: str = "fp32"    # sparseloco: fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | fp4_e2m1
    # Streaming DiLoCo: each fragment synchronized every H steps, one of them every H/F steps
    # (strided over the blocks), so a round moves 1/F of the model
    fragments: int = 1                # diloco: Streaming DiLoCo's fragments F (1: plain DiLoCo)
    # diloco: the outer gradient's all-reduce in fp32, or quantized with payload.py's codecs
    # (a sum accumulated in fp32), outer_payload_chunk values at a time (~30 B of temporaries
    # each); outer_error_feedback beta > 0 carries each worker's rounding into its next round
    # (e <- what x = delta + beta * e did not deliver); 0 drops it (Streaming DiLoCo's rule)
    outer_payload_dtype: str = "fp32"   # fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | fp4_e2m1
    outer_payload_chunk: int = OUTER_PAYLOAD_CHUNK   # values per quantized all-reduce call
    outer_error_feedback: float = 0.0     # beta in [0, 1]; needs a quantized outer_payload_dtype
    seed: int = 0                     # the mixing graph's RNG seed (with the round number)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    max_rounds: Optional[int] = None  # informational: the run ends at trainer.max_steps, i.e.
                                      # after max_steps // inner_steps rounds; validated >= 1
