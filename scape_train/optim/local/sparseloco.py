"""SparseLoCo's outer round (Sarfi et al., arXiv 2508.15706): DiLoCo's rounds, with the outer
momentum replaced by an error feedback kept by each worker, and only the largest entries of it
sent.

For worker r in a round (``e_r`` starts at zero):

    delta_r = theta0 - theta_r              the round's drift
    e_r     = beta * e_r + delta_r          ``sparse_error_decay`` beta
    s_r     = Q(topk_chunks(e_r))           the ``sparse_topk`` largest |e_r| of every chunk of
                                            ``sparse_chunk`` values, Q the payload codec
                                            (``sparse_payload_dtype``), as decoded
    e_r     = e_r - s_r                     what was not sent, and Q's rounding, stay behind
    delta   = (1/R) sum_r s_r               an ALL-GATHER of every worker's (index, value) list
    theta0  = theta = the outer step of DiLoCo on delta (outer_lr eta; outer_momentum 0, the
                      paper's, makes it theta0 - eta * delta)

Elastic runs (torchft replica groups): a round whose all-gather or vote fails is applied by
nobody; each worker puts its ``e_r`` back as it was before the round (its drift is still in theta
and joins the next round whole). A worker healing from a live peer takes the peer's committed
point but never its error feedback: a joiner, or a restarted worker, starts its own at zero.

The chunks tile the parameters laid end to end in their order (one flat buffer, zero-padded to
whole chunks), so a chunk at a tensor's end holds the next tensor's start. A worker sends
``chunks * k`` values in the codec's wire format (payload.py: fp32, bf16, fp8 with a power-of-two
scale per 128 values) and their int16 positions within their chunks, each part padded to whole
4-byte words; the paper's 2-bit values are not offered. Every worker decodes the same gathered bytes and adds the workers' lists in rank
order, so every replica holds the same delta and the same parameters, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scape_train.comm import Comm
from ..scape.payload import PayloadCodec
from .outer import OuterAlgorithm, PendingRound

MAX_CHUNK = 32768           # positions within a chunk go as int16


@dataclass(frozen=True)
class MessageLayout:
    """What one worker sends per round, for ``numel`` parameters (the memory plan reads it too)."""
    chunks: int              # chunks of ``chunk`` values tiling the parameters
    padded: int              # chunks * chunk: the error feedback's length
    sent: int                # values sent: chunks * topk
    value_bytes: int         # the coded values, zero-padded to whole 4-byte words (every field
                             # of every gathered message stays aligned for its dtype)
    message_bytes: int       # then the int16 positions, padded the same way

    @classmethod
    def of(cls, numel: int, chunk: int, topk: int, codec: PayloadCodec) -> "MessageLayout":
        chunks = -(-numel // chunk)
        sent = chunks * topk
        value_bytes = -(-codec.nbytes(sent) // 4) * 4
        return cls(chunks, chunks * chunk, sent, value_bytes, value_bytes + -(-2 * sent // 4) * 4)


class SparseLoCo(OuterAlgorithm):
    all_reduce_kind = None   # its round is an all-gather (kind ``outer``)

    def __init__(self, params: list[torch.Tensor], names: list[str], comm: Comm, eta: float,
                 gamma: float, on_cpu: bool, *, chunk: int, topk: int, error_decay: float,
                 payload_dtype: str, rounds_can_fail: bool = False):
        super().__init__(params, names, comm, eta, gamma, on_cpu)
        if not 1 <= topk <= chunk <= MAX_CHUNK:
            raise ValueError(f"sparseloco needs 1 <= sparse_topk <= sparse_chunk <= {MAX_CHUNK}, "
                             f"got sparse_topk={topk}, sparse_chunk={chunk}")
        self.chunk, self.topk, self.beta = chunk, topk, error_decay
        self.codec = PayloadCodec(payload_dtype)
        self.numel = sum(p.numel() for p in params)
        layout = MessageLayout.of(self.numel, chunk, topk, self.codec)
        self.chunks, self.sent = layout.chunks, layout.sent
        self.value_bytes, self.message_bytes = layout.value_bytes, layout.message_bytes
        # this worker's error feedback, fp32, padded to whole chunks (the padding stays zero)
        self.error = torch.zeros(layout.padded, dtype=torch.float32, device=params[0].device)
        # elastic runs: a round that does not commit is applied by nobody, and its drift stays in
        # theta to join the next round, so the error feedback goes back to where it was before
        # the round (a copy of it, held through the round)
        self.rounds_can_fail = rounds_can_fail

    # -- the round -----------------------------------------------------------------------------
    def compress(self, keep_local: bool = False
                 ) -> tuple[torch.Tensor, float, float, torch.Tensor | None]:
        """Fold this round's drift into the error feedback, take its top-k of every chunk out of
        it, and return (the message: coded values then int16 positions, as uint8; the drift
        norm; the error norm left; with ``keep_local`` this worker's own drift)."""
        delta = self.drift_flat()
        with torch.no_grad():
            drift = float(torch.linalg.vector_norm(delta))
            local = delta.clone() if keep_local else None
            e = self.error
            e[:self.numel].mul_(self.beta).add_(delta.float())
            rows = e.view(self.chunks, self.chunk)
            index = rows.abs().topk(self.topk, dim=1, sorted=False).indices
            coded = self.codec.encode(rows.gather(1, index).reshape(1, -1))
            sent = self.codec.decode(coded, self.sent).view(self.chunks, self.topk)
            rows.scatter_add_(1, index, sent.neg())      # e -= s: exactly what others receive
            message = torch.zeros(self.message_bytes, dtype=torch.uint8, device=e.device)
            message[:coded.numel()] = coded.reshape(-1)
            positions = index.to(torch.int16).reshape(-1).view(torch.uint8)
            message[self.value_bytes:self.value_bytes + positions.numel()] = positions
            left = float(torch.linalg.vector_norm(e))
        return message, drift, left, local

    def start_gather(self, async_op: bool, keep_local: bool = False):
        """The round's message all-gathered (``async_op``: not waited for). Returns the receive
        buffer, its handle, the drift norm, the error norm and the own drift (``keep_local``)."""
        message, drift, left, local = self.compress(keep_local)
        gathered = message.new_empty(self.comm.world * self.message_bytes)
        handle = self.comm.all_gather(gathered, message, kind="outer", async_op=async_op)
        return gathered, handle, drift, left, local

    def mean_delta(self, gathered: torch.Tensor) -> torch.Tensor:
        """``(1/R) sum_r s_r`` from the gathered messages, added in rank order; flat, in the
        parameters' dtype."""
        total = torch.zeros(self.chunks, self.chunk, dtype=torch.float32, device=gathered.device)
        for message in gathered.view(self.comm.world, self.message_bytes):
            index = message[self.value_bytes:self.value_bytes + 2 * self.sent].view(torch.int16)
            values = self.codec.decode(message[:self.codec.nbytes(self.sent)].view(1, -1), self.sent)
            total.scatter_add_(1, index.long().view(self.chunks, self.topk),
                               values.view(self.chunks, self.topk))
        total.div_(self.comm.world)
        return total.view(-1)[:self.numel].to(self.params[0].dtype)

    def round_metrics(self, drift: float, committed: bool, left: float = 0.0) -> dict[str, float]:
        return {**super().round_metrics(drift, committed), "outer/error_norm": left}

    def round(self, t: int) -> dict[str, float]:
        before = self.error.clone() if self.rounds_can_fail else None
        gathered, _, drift, left, _ = self.start_gather(async_op=False)
        committed = self.apply_all_reduce(self.mean_delta(gathered))
        if not committed and before is not None:
            self.error.copy_(before)      # e_r as if the round had not been: nobody applied s_r
            left = float(torch.linalg.vector_norm(before))
        return self.round_metrics(drift, committed, left)

    def start_round(self, t: int, keep_local: bool) -> tuple[PendingRound, dict[str, float]]:
        gathered, handle, drift, left, local = self.start_gather(async_op=True,
                                                                 keep_local=keep_local)
        pending = PendingRound("delta", handle, lambda: self.mean_delta(gathered), local)
        return pending, self.round_metrics(drift, True, left)

    # -- state ---------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"error": self.error}

    def load_extra_state(self, state: dict) -> None:
        saved = state.get("error")
        if saved is None or saved.numel() != self.error.numel():
            raise KeyError("the checkpoint holds no SparseLoCo error feedback of this model's "
                           f"size ({self.error.numel()} values, chunk {self.chunk}): it was saved "
                           "by another strategy, model or sparse_chunk")
        self.error.copy_(saved)

