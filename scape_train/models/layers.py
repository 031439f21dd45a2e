"""Building blocks shared by the GPT and Llama models, and their common base class.

Conventions kept identical to Hugging Face's GPT-2 and Llama so that export is a pure renaming
(plus GPT-2's Conv1D transposes): the Llama rotary embedding uses the rotate-half layout, RMSNorm
normalizes in fp32, and grouped-query heads share keys/values in consecutive groups.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from scape_train.models.cache import KVCache, LayerCache
from scape_train.models.config import ModelConfig
from scape_train.models.loss import chunk_loss_and_grad, linear_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (1-D, so optimizers exclude it from decay)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in fp32: in bf16 it loses most of its mantissa.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``cos, sin`` of shape [seq_len, head_dim], in fp32.

    Computed per forward rather than kept as a buffer: a buffer would be cast to bf16 by
    ``model.to(dtype)`` and left uninitialized by ``to_empty``; the cost is O(T * head_dim).
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout: pairs are (i, i + head_dim/2)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, head_dim] by position; ``cos``/``sin`` are [T, head_dim] (or
    [B, 1, T, head_dim]: per-row positions, for left-padded incremental decoding)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped key/value heads and rotary positions.

    ``attn_dropout`` drops attention probabilities; ``resid_dropout`` drops the block output.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool,
        attn_dropout: float = 0.0,
        resid_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.attn_dropout = attn_dropout
        self.wq = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.resid_drop = nn.Dropout(resid_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        mask, causal = None, True
        if cache is not None:  # incremental decoding: attend over everything cached so far
            k, v = cache.update(k, v)
            mask, causal = cache.parent.attn_mask, cache.parent.is_causal
        # enable_gqa lets SDPA share each K/V head across n_heads / n_kv_heads consecutive query
        # heads without materializing the repeated tensors (same grouping as HF's repeat_kv).
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=causal,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.resid_drop(self.wo(y))


    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v from ONE matmul over the three weights side by side: one GEMM of 3x the
        width is faster than three (CPU and GPU alike); the concatenation copies the weights
        (d x 3d, small against the activations) and its backward only slices the gradient.
        The parameters stay wq/wk/wv (Hugging Face names, checkpoints, SCAPE's layout)."""
        weight = torch.cat((self.wq.weight, self.wk.weight, self.wv.weight))
        bias = (torch.cat((self.wq.bias, self.wk.bias, self.wv.bias))
                if self.wq.bias is not None else None)
        kv = self.n_kv_heads * self.head_dim
        return F.linear(x, weight, bias).split((self.n_heads * self.head_dim, kv, kv), dim=-1)


class SwiGLU(nn.Module):
    """Llama feed-forward: ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class GeluMLP(nn.Module):
    """GPT-2 feed-forward with the tanh-approximated GeLU that GPT-2 was trained with."""

    def __init__(self, d_model: int, ffn_dim: int, bias: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.w_up = nn.Linear(d_model, ffn_dim, bias=bias)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w_down(F.gelu(self.w_up(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, attn_norm: nn.Module, attn: Attention, mlp_norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.mlp(self.mlp_norm(x))


def padded_vocab(cfg: ModelConfig) -> int:
    """Embedding rows: the vocab rounded up to ``vocab_pad_multiple`` (aligned matmuls on GPUs)."""
    m = cfg.vocab_pad_multiple
    return (cfg.vocab_size + m - 1) // m * m


class CausalLM(nn.Module):
    """What GPT and Llama share: input checks, the output head, init, counting.

    Subclasses define ``tok_emb``, ``layers``, ``norm`` and ``lm_head`` (None when tied to
    ``tok_emb``), and list the input-embedding tables in ``EMBEDDINGS``.
    """

    # Output projections of residual branches: their init std is scaled by 1/sqrt(2*n_layers) so
    # the residual stream's variance does not grow with depth (GPT-2 paper, section 2.3).
    RESIDUAL_PROJECTIONS = ("attn.wo", "mlp.w_down")
    EMBEDDINGS: tuple[str, ...] = ("tok_emb",)

    tok_emb: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size  # the tokenizer's vocab; rows beyond it are padding
        # How the training loss is computed (not the model's shape, so not in ModelConfig): the
        # trainer sets them from its config (models/training.py); 0 = over the full logits.
        self.loss_chunk_tokens = 0
        self.loss_chunk_fn = chunk_loss_and_grad

    def _check_input(self, input_ids: torch.Tensor) -> int:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                "shorten the sequences or raise model.max_seq_len"
            )
        return t

    def _logits(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The head over the padded width (aligned GEMM rows: an odd width like GPT-2's 50257
        makes the matmul and the softmax measurably slower, on CPUs too); the padded columns
        are sliced off for consumers, or masked for the loss. With ``targets``, the mean loss
        (``models/loss.py``: chunk by chunk when the tokens exceed ``loss_chunk_tokens``)."""
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        if targets is not None:
            return linear_cross_entropy(h, weight, targets, self.vocab_size,
                                        self.loss_chunk_tokens, self.loss_chunk_fn)
        logits = F.linear(h, weight)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]    # out of every consumer's argmax
        return logits

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter from the current torch RNG (deterministic under a seed).

        Linear and embedding weights ~ N(0, init_std); residual output projections ~
        N(0, init_std / sqrt(2 * n_layers)); biases 0; norm gains 1 (LayerNorm biases 0).
        """
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_resid = name.endswith(self.RESIDUAL_PROJECTIONS)
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                module.reset_parameters()

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once). ``exclude_embeddings`` drops the input tables
        (token and, for GPT, position embeddings); an untied ``lm_head`` is still counted."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(getattr(self, n).weight.numel() for n in self.EMBEDDINGS)
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate:

            6 * N + 12 * n_layers * d_model * seq_len

        N = non-embedding parameters plus the output-head matrix (counted even when tied to the
        token embedding, since the head matmul is performed; padded rows included, since they are
        computed). 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward). The second term is the
        attention score and value matmuls (QK^T and AV), counted without the causal-mask halving.
        """
        n = self.num_params(exclude_embeddings=True)
        if self.lm_head is None:
            n += self.tok_emb.weight.numel()
        return float(6 * n + 12 * self.cfg.n_layers * self.cfg.d_model * seq_len)
