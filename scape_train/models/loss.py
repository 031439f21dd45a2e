"""The next-token loss from the last hidden states and the head weight, a chunk of tokens at a time.

``F.cross_entropy`` over the full logits keeps B x T x V of them alive, plus their fp32 copy under
bf16 autocast (Llama-500M at 16 x 4096 tokens and a 32k vocabulary: 4.2 GB + 8.4 GB), and their
gradient of the same size in backward. Here the tokens go through in chunks: a chunk's logits are
computed, upcast to fp32, reduced to its loss, and turned at once into the chunk's share of the
gradients of the hidden states and of the head weight, then freed. The loss is a scalar, so its
gradient is known in the forward up to the factor backward brings (``grad_output``, e.g.
1 / accumulation steps); backward only scales what the forward computed. One chunk of logits is
ever alive, no GEMM runs twice, and the head-weight gradient is summed over chunks in fp32.

The numbers are those of ``F.cross_entropy(F.linear(h, w).float(), targets)`` with the padded
vocabulary columns masked: a mean over the targets that are not ``IGNORE_INDEX``, logits in the
autocast dtype (or the inputs' without autocast), softmax in fp32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100          # F.cross_entropy's default: such targets add nothing to the mean


def chunk_loss_and_grad(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        vocab_size: int, want_grad: bool):
    """One chunk: (summed loss, d loss_sum / d logits in the logits' dtype or None).

    ``h`` [n, d] and ``weight`` [V_padded, d] are already in the compute dtype; columns from
    ``vocab_size`` on are padding and get probability 0. This is the part ``torch.compile`` fuses
    (the fp32 softmax over the chunk's logits) when the trainer compiles the model."""
    logits = h @ weight.t()
    z = logits.float()
    if z.shape[-1] != vocab_size:
        z[:, vocab_size:] = float("-inf")
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    target_logit = z.gather(1, safe[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
    if not want_grad:
        return loss_sum, None
    # d loss_sum / d z = softmax(z) - onehot(target), per valid row; built in z's storage
    grad = z.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -valid[:, None].to(grad.dtype))
    grad.mul_(valid[:, None])
    return loss_sum, grad.to(logits.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, chunk_tokens: int, dtype, chunk_fn):
        want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        device_type = h.device.type
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype)
            count = (targets != IGNORE_INDEX).sum().clamp_min(1)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
            for start in range(0, h.shape[0], chunk_tokens):
                h_c = h[start:start + chunk_tokens].to(dtype)
                part, g = chunk_fn(h_c, w, targets[start:start + chunk_tokens], vocab_size, want)
                loss = loss + part
                if grad_h is not None:
                    grad_h[start:start + chunk_tokens] = g @ w
                if grad_w is not None:        # each chunk's GEMM in the compute dtype, summed in fp32
                    grad_w += (g.t() @ h_c).float()
        ctx.save_for_backward(grad_h, grad_w, count)
        return loss / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out / count
        dh = None if grad_h is None else grad_h * scale.to(grad_h.dtype)
        dw = None if grad_w is None else grad_w * scale
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         vocab_size: int, chunk_tokens: int,
                         chunk_fn: Callable = chunk_loss_and_grad) -> torch.Tensor:
    """Mean cross-entropy of ``h`` [..., d] through the head ``weight`` [V_padded, d] against
    ``targets`` [...]: over the full logits when they fit in one chunk (``chunk_tokens`` <= 0,
    or no more tokens than that), else chunk by chunk (the module's docstring)."""
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if chunk_tokens <= 0 or h2.shape[0] <= chunk_tokens:
        return full_cross_entropy(F.linear(h2, weight), t, vocab_size)
    device_type = h.device.type
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else h.dtype)
    return _ChunkedLinearCrossEntropy.apply(h2, weight, t, vocab_size, chunk_tokens, dtype, chunk_fn)


def full_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy over the real vocab, read from the padded logits: the padded columns
    are set to -inf in place (B x T x pad elements), so the softmax gives them 0 -- the loss of the
    sliced logits, without the [B, T, V] copy a strided slice costs the loss and its backward.
    Computed in fp32 (the logits may be bf16 under autocast)."""
    if logits.shape[-1] != vocab_size:
        # Outside autograd: recorded, the fill's backward would clone the whole [B, T, V]
        # gradient. Unrecorded, the loss's gradient at the masked columns is softmax = 0,
        # which is the true gradient there (the loss does not depend on them).
        with torch.no_grad():
            logits[..., vocab_size:] = float("-inf")
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
