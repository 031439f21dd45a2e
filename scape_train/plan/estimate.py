"""The plan itself: per-device peak memory of a composed config, in three phases.

    forward/backward   parameters, optimizer state, gradients (as alive at the peak), the saved
                       activations of one micro-batch, the logits and loss, backward temporaries
    optimizer step     parameters, optimizer state, all gradients, the logits the training loop
                       still references, the step's transients
    checkpoint         parameters, optimizer state, the state dict's device copies (SCAPE)

The forward/backward column comes from ``trace.trace_micro_batch`` (fake tensors), or -- when
``trace="auto"`` and even a generous closed-form bound fits -- from that bound (``bound``), which
keeps the trainer's start-up check to milliseconds for small jobs. Everything is per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scape_train.config import Config, grad_accum_steps
from scape_train.plan.devices import DeviceSpec, GiB
from scape_train.plan.optimizer_memory import F32, OptimizerMemory, optimizer_memory
from scape_train.plan.tracker import CUDA_BLOCK
from scape_train.plan.trace import MicroBatchTrace, math_attention

PHASES = ("forward/backward", "optimizer step", "checkpoint")


@dataclass(frozen=True)
class Row:
    name: str
    cells: tuple[int | None, ...]     # bytes per phase; None = not alive in that phase


@dataclass
class MemoryPlan:
    label: str
    device: DeviceSpec
    world_size: int
    micro_batch_size: int
    accum: int
    seq_len: int
    precision: str                    # "bf16" | "fp32" (autocast resolved for the device)
    activation_checkpointing: str     # none|selective|full|full_every_N (auto: choose_checkpointing)
    rows: list[Row]
    host: list[tuple[str, int]] = field(default_factory=list)
    traced: bool = True               # False: the forward/backward column is the closed-form bound
    notes: list[str] = field(default_factory=list)

    def totals(self) -> list[int]:
        return [sum(r.cells[i] or 0 for r in self.rows) for i in range(len(PHASES))]

    @property
    def peak(self) -> int:
        return max(self.totals())

    @property
    def peak_phase(self) -> str:
        totals = self.totals()
        return PHASES[totals.index(max(totals))]

    @property
    def fits(self) -> bool:
        return self.peak <= self.device.usable

    def verdict(self) -> str:
        gib = lambda b: f"{b / GiB:.1f} GiB"   # noqa: E731
        what = (f"{self.label}: peak {gib(self.peak)} per rank ({self.peak_phase}) on "
                f"{self.device.name}, usable {gib(self.device.usable)} of {gib(self.device.capacity)}")
        return f"{what}: {'fits' if self.fits else 'does not fit'}"


def planned_vocab(cfg: Config) -> int:
    """The vocabulary the model will have, before the tokenizer exists: ``model.vocab_size``, else
    the tokenizer config's ``vocab_size`` (a trained BPE's target; the shipped configs give the
    pretrained tokenizers' sizes there too: GPT-2 50257, Llama-2 32000)."""
    return cfg.model.vocab_size or cfg.data.tokenizer.vocab_size


def uses_bf16(cfg: Config, device: DeviceSpec) -> bool:
    """The trainer's ``autocast_context`` for this device: auto = bf16 on GPUs (every listed one
    supports it), fp32 on CPUs."""
    p = cfg.trainer.precision
    return p == "bf16" or (p == "auto" and device.on_gpu)


def checkpointing_of(cfg: Config) -> str:
    """``trainer.activation_checkpointing`` as none|selective|full|full_every_N|auto."""
    from scape_train.models.checkpointing import parse_policy

    return parse_policy(cfg.trainer.activation_checkpointing)


def with_checkpointing(cfg: Config, policy: str) -> Config:
    return replace(cfg, trainer=replace(cfg.trainer, activation_checkpointing=policy))


def _saved_per_block(policy: str, d: int, kv: int, f: int, h: int, e: int, block: int) -> int:
    """Bytes per token a block keeps for backward under ``policy`` (models/checkpointing.py):
    full keeps its fp32 input; selective adds its GEMM outputs (q/k/v, wo, gate, up, down) and
    attention's output and log-sum-exp; none keeps (at most) everything its forward made."""
    if policy == "full":
        return 4 * d
    if policy == "selective":
        return 4 * d + e * (4 * d + 2 * kv + 2 * f) + 4 * h
    return block


def _logits_bound(tokens: int, v: int, d: int, e: int, chunk: int) -> tuple[int, int]:
    """(peak, held after backward) of the head and the loss (models/loss.py). Full logits: the
    logits, their fp32 copy and gradients, the loss internals; the logits stay referenced until
    the next forward. Chunked: one chunk's logits chain, the hidden states' gradient (fp32 and
    the chunk's), the head weight in the compute dtype and its fp32 gradient sum; nothing held."""
    if chunk <= 0 or tokens <= chunk:
        return tokens * v * (16 + 2 * e), tokens * (v * e + 16)
    return chunk * v * (16 + 2 * e) + tokens * d * (4 + e) + v * d * (8 + 2 * e), tokens * 16


def activation_bound(cfg: Config, vocab: int, bf16: bool, on_gpu: bool, accum: int,
                     n_params: int, param_bytes: int) -> MicroBatchTrace:
    """A closed-form upper bound of ``trace_micro_batch``: every tensor a block's forward produces
    (not only those saved) for every block -- or what the checkpointing policy keeps of them plus
    one block's recompute --, the logits' forward and backward chain, one block's backward
    temporaries, and the autocast weight copies. ``tests/test_plan.py`` checks it against the
    trace."""
    from scape_train.models.build import resolve_config
    from scape_train.models.checkpointing import block_policies
    from scape_train.models.layers import padded_vocab

    m = resolve_config(cfg.model, vocab)
    b, t = cfg.trainer.micro_batch_size, cfg.data.seq_len
    tokens, e = b * t, (2 if bf16 else 4)
    d, f, h = m.d_model, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * (d // h)
    v = padded_vocab(m)
    block = 32 * d + e * (16 * d + 7 * kv + 4 * f) + 4 * h       # bytes per token, forward outputs
    if m.dropout > 0 or math_attention(m, on_gpu, bf16, cfg.trainer.attention_backend):
        block += 3 * 4 * h * t                                   # the math kernel: B x H x T x T
    policy = checkpointing_of(cfg)
    # what each block keeps, plus one block's recompute where any block recomputes
    layers = sum(_saved_per_block(p, d, kv, f, h, e, block)
                 for p in block_policies(policy, m.n_layers))
    layers += 0 if policy == "none" else block
    activations = tokens * (layers + 16 * d) + (e * n_params if bf16 else 0)
    logits, held = _logits_bound(tokens, v, d, e, cfg.trainer.loss_chunk_tokens)
    backward = tokens * 4 * (4 * f + 4 * d)
    grads = param_bytes
    if accum > 1:   # the second micro-batch runs beside the first one's gradients and logits
        activations += held
    return MicroBatchTrace(params=param_bytes, grads=grads, peak=0, peak_grads=grads,
                           peak_activations=activations, peak_logits=logits, peak_backward=backward,
                           held_after=held, ops=0)


def _rows(params: int, opt: OptimizerMemory, fb: MicroBatchTrace, bf16: bool) -> list[Row]:
    rows = [Row("parameters (fp32)", (params, params, params))]
    rows += [Row(name, (b, b, b)) for name, b in opt.state]
    if opt.grads_persistent:        # SCAPE's flat buffer or DDP's buckets, alive through the
        # forward and checkpoints too (zero_grad zeroes or unlinks them, never frees them), and
        # the largest gradient autograd makes before adding it in
        rows.append(Row("gradients (fp32, persistent buffers)",
                        (fb.grads + opt.grads_transient, fb.grads, fb.grads)))
    else:
        rows.append(Row("gradients (fp32)", (fb.peak_grads, fb.grads, None)))
    rows.append(Row(f"activations of one micro-batch ({'bf16 autocast' if bf16 else 'fp32'})",
                    (fb.peak_activations, None, None)))
    rows.append(Row("logits + loss (fp32 upcast, or one chunk; step: logits still held)",
                    (fb.peak_logits, fb.held_after, None)))
    rows.append(Row("backward temporaries", (fb.peak_backward, None, None)))
    rows.append(Row(f"optimizer step transients ({opt.step_where})", (None, opt.step, None)))
    if opt.checkpoint:
        rows.append(Row(f"checkpoint transients ({opt.checkpoint_where})", (None, None, opt.checkpoint)))
    return rows


def plan_memory(cfg: Config, world_size: int, device: DeviceSpec, trace: bool | str = "auto",
                label: str = "") -> MemoryPlan:
    """The plan of ``cfg`` on ``world_size`` ranks of ``device``. ``trace``: True = always trace
    the forward/backward; "auto" = only when the closed-form bound does not already fit.
    ``activation_checkpointing=auto`` plans the policy ``choose_checkpointing`` picks."""
    if checkpointing_of(cfg) == "auto":
        return choose_checkpointing(cfg, world_size, device, trace, label)
    from scape_train.models.build import build_model

    vocab = planned_vocab(cfg)
    meta = build_model(cfg.model, vocab_size=vocab, device="meta")
    params = [p for p in meta.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    block = CUDA_BLOCK if device.on_gpu else 1      # as the trace counts them
    param_bytes = sum(-(-F32 * p.numel() // block) * block for p in params)
    accum = grad_accum_steps(cfg, world_size)
    bf16 = uses_bf16(cfg, device)
    opt = optimizer_memory(cfg, meta, world_size, device.on_gpu)
    t = cfg.trainer
    policy = checkpointing_of(cfg)
    plan = MemoryPlan(label or cfg.run_name, device, world_size, t.micro_batch_size, accum,
                      cfg.data.seq_len, "bf16" if bf16 else "fp32", policy,
                      rows=[], host=list(opt.host))
    bound = activation_bound(cfg, vocab, bf16, device.on_gpu, accum, n_params, param_bytes)
    if trace == "auto":
        bounded = replace(plan, rows=_rows(param_bytes, opt, bound, bf16), traced=False)
        if bounded.fits:
            return bounded
    if trace is False:
        return replace(plan, rows=_rows(param_bytes, opt, bound, bf16), traced=False)
    from scape_train.plan.trace import trace_micro_batch

    fb = trace_micro_batch(cfg.model, vocab, t.micro_batch_size, cfg.data.seq_len, bf16=bf16,
                           activation_checkpointing=policy, accum=accum, on_gpu=device.on_gpu,
                           loss_chunk_tokens=t.loss_chunk_tokens,
                           attention_backend=t.attention_backend)
    return replace(plan, rows=_rows(fb.params, opt, fb, bf16), traced=True)


def choose_checkpointing(cfg: Config, world_size: int, device: DeviceSpec,
                         trace: bool | str = "auto", label: str = "") -> MemoryPlan:
    """``activation_checkpointing=auto``: the plan of the first policy that fits, in order of
    recompute -- none, selective, full_every_4, full_every_2, full (``checkpointing.LADDER``) --,
    or full's plan when none fits (which the trainer's check then refuses, naming the change
    that fits). The chosen policy is the plan's ``activation_checkpointing``."""
    from scape_train.models.checkpointing import LADDER

    for policy in LADDER:
        plan = plan_memory(with_checkpointing(cfg, policy), world_size, device, trace, label)
        if plan.fits:
            break
    plan.notes.append(f"activation checkpointing auto: {plan.activation_checkpointing}, "
                      f"the least recompute {'that fits' if plan.fits else '(none fits)'}")
    return plan
