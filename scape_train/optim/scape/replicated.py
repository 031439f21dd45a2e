"""SCAPE with replicated state (spec §2): every rank holds θ, the full momentum m, its residual.

Per step (lines 1-7; the next mask, line 8, is the strategy's job):

    c^(r) = β1·m + (1-β1)·g^(r) + e^(r)                    prepare(): one pass over e
    e^(r) = (1 - M) ⊙ c^(r)                                 (same pass when M is known)
    b̄     = mean_r c^(r)[M]                                  ONE all-reduce of the payload
            (low precision, ``payload_dtype``: the all-to-all / fp32 sum / all-gather of
            :func:`payload.all_reduce_mean`, or across torchft's replica groups the all-gather
            of :func:`payload.all_gather_mean`; e^(r)[M] = the rank's quantization error)
    ĝ     = M ⊙ (b̄ - β1·m) / (1-β1);  clip ĝ by its global norm
    m, θ  ← AdamS(m, ĝ) with m zeroed off M                 off M: θ ← (1 - lr·wd)·θ
"""

from __future__ import annotations

import torch

from ..adams import adams_update_
from scape_train.comm import Comm
from ..config import OptimizerConfig
from .kernels import gather_masked, scatter_masked
from .masks import Mask
from .partition import ParamLayout, PartitionMap
from .passes import clip_coef
from .payload import PayloadCodec, quantized_mean
from .residual import ResidualStore
from .state import ScapeState


class ReplicatedScape:
    mode = "replicated"

    def __init__(self, layout: ParamLayout, part: PartitionMap, cfg: OptimizerConfig, comm: Comm):
        self.layout, self.part, self.cfg, self.comm = layout, part, cfg, comm
        dev, n = layout.device, layout.total
        self.state = ScapeState(
            m=torch.zeros(n, dtype=torch.float32, device=dev),
            residual=ResidualStore(n, dev, cfg.offload_residuals, cfg.offload_chunk_numel))
        self.codec = PayloadCodec(cfg.payload_dtype)
        self.record = False          # tests: keep this step's candidate in ``last``
        self.last: dict[str, torch.Tensor] = {}
        self._c: torch.Tensor | None = None
        self._res_sq = torch.zeros((), dtype=torch.float64, device=dev)

    # -- line 1 (and 3) ------------------------------------------------------------------------
    def prepare(self, g: torch.Tensor, mask: Mask | None, counts=None) -> torch.Tensor:
        """Local candidate ``c``; folds the residual when ``mask`` is known. Returns ``c`` on the
        owned range (the next-mask statistic). ``counts`` (M_t's ones per segment, as
        :meth:`update` takes them) is part of the engines' common call; this step reads the
        mask whole and does not need it."""
        beta1 = self.cfg.betas[0]
        c = torch.mul(self.state.m, beta1).add_(g, alpha=1.0 - beta1)
        self._res_sq = self.state.residual.fold(c, None if mask is None else mask.dense())
        self._c = c
        lo, hi = self.part.ranges[self.comm.rank]
        return c[lo:hi]

    def finish_residual(self, mask: Mask) -> None:
        assert self._c is not None
        self._res_sq = self.state.residual.set_from(self._c, mask.dense())

    # -- lines 2, 4-7 --------------------------------------------------------------------------
    def update(self, mask: Mask, lr: float, step: int, counts: list[list[int]],
               during_payload=None) -> tuple[dict, None]:
        """``counts``: the mask's ones per segment of every rank, known on the host (the density
        schedule), so that no size is read back from the device. Returns the metrics and what
        ``during_payload`` (work to overlap with the payload's collective) returned: ``None``
        here, where it is not run (this engine overlaps nothing; the caller runs it after)."""
        bits = mask.dense()     # M_t's bool tensor: the reference reads the mask whole
        cfg, c = self.cfg, self._c
        assert c is not None, "prepare() first"
        beta1, beta2 = cfg.betas
        if self.record:
            self.last = {"c": c.clone(), "m_prev": self.state.m.clone()}
        k = sum(map(sum, counts))
        payload = gather_masked(c, bits, count=k)
        if self.codec.lowp:
            # the mean, identical on every rank; this rank's error goes into its residual
            payload, err = quantized_mean(payload, self.comm, self.codec, kind="payload")
            self._res_sq = self._res_sq + self.state.residual.set_masked(err, bits, k)
            if self.record:
                self.last["wire_error"] = err.clone()
        else:
            self.comm.all_reduce(payload, kind="payload", average=True)
        ghat_c = gather_masked(self.state.m, bits, count=k)
        ghat_c.mul_(-beta1).add_(payload).div_(1.0 - beta1)    # (b̄ - β1·m) / (1-β1)
        norm = torch.linalg.vector_norm(ghat_c)
        if cfg.clip_grad > 0:
            ghat_c.mul_(clip_coef(norm, cfg.clip_grad))
        ghat = torch.zeros_like(c)
        scatter_masked(ghat_c, bits, ghat, count=k)
        if self.record:
            self.last.update(payload=payload.clone(), ghat=ghat.clone())
        for i, p in enumerate(self.layout.params):
            a, b = self.layout.offsets[i], self.layout.offsets[i + 1]
            adams_update_(p.data.view(-1), self.state.m[a:b], ghat[a:b], step=step, lr=lr,
                          beta1=beta1, beta2=beta2, eps=cfg.eps,
                          weight_decay=self.layout.weight_decay[i],
                          bias_correction=cfg.bias_correction, mask=bits[a:b])
        self._c = None
        return {"grad_norm": norm, "scape/payload_numel": float(k),
                "scape/residual_norm": self._res_sq.sqrt()}, None

    def finish_step(self) -> dict[str, torch.Tensor]:
        """End of the step, after the next mask's top-k: nothing left to do (the residual was
        folded by prepare() or finish_residual())."""
        return {}

    # -- state in model space ------------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """Flat momentum, rank-independent residual part (none here) and this rank's residual
        (copies: tests and the in-memory ``state_dict``)."""
        return {"momentum": self.state.m.clone(), "residual": self.state.residual.full()}

    @property
    def state_range(self) -> tuple[int, int]:
        """The flat range of the momentum this engine holds: all of it."""
        return 0, self.layout.total

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live flat state by kind, not copied: the momentum is the same on every rank
        (replicated), the residual is this rank's own."""
        return {"replicated": {"momentum": self.state.m}, "sharded": {},
                "per_rank": {"residual": self.state.residual.tensor()}}

    def load_range_state(self, momentum: torch.Tensor, shared: torch.Tensor | None,
                         residual: torch.Tensor | None) -> None:
        """``momentum`` and ``shared`` over :attr:`state_range`; ``residual`` full, or None to
        reset it."""
        self.state.m.copy_(momentum)
        total = residual if residual is not None else torch.zeros_like(self.state.m)
        if shared is not None:       # from a sharded checkpoint: e = ρ + ε
            total = total + shared
        self.state.residual.load(total)
