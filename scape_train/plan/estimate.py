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
from scape_train.plan.trace import MicroBatchTrace

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
    activation_checkpointing: bool
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


def activation_bound(cfg: Config, vocab: int, bf16: bool, on_gpu: bool, accum: int,
                     n_params: int, param_bytes: int) -> MicroBatchTrace:
    """A closed-form upper bound of ``trace_micro_batch``: every tensor a block's forward produces
    (not only those saved) for every block, the logits' whole forward and backward chain, one
    block's backward temporaries, and the autocast weight copies. ``tests/test_plan.py`` checks
    it against the trace."""
    from scape_train.models.build import resolve_config
    from scape_train.models.layers import padded_vocab

    m = resolve_config(cfg.model, vocab)
    b, t = cfg.trainer.micro_batch_size, cfg.data.seq_len
    tokens, e = b * t, (2 if bf16 else 4)
    d, f, h = m.d_model, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * (d // h)
    v = padded_vocab(m)
    block = 32 * d + e * (16 * d + 7 * kv + 4 * f) + 4 * h       # bytes per token, forward outputs
    gqa = m.n_kv_heads != m.n_heads
    if m.dropout > 0 or (on_gpu and not bf16 and gqa):          # the math kernel: B x H x T x T
        block += 3 * 4 * h * t
    layers = (m.n_layers * 4 * d + block) if cfg.trainer.activation_checkpointing else m.n_layers * block
    activations = tokens * (layers + 16 * d) + (e * n_params if bf16 else 0)
    logits = tokens * v * (16 + 2 * e)
    backward = tokens * 4 * (4 * f + 4 * d)
    grads = param_bytes
    held = tokens * (v * e + 16)                                # the logits, and x, y (int64)
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
    rows.append(Row("logits + loss (fp32 upcast; step: logits still held)",
                    (fb.peak_logits, fb.held_after, None)))
    rows.append(Row("backward temporaries", (fb.peak_backward, None, None)))
    rows.append(Row(f"optimizer step transients ({opt.step_where})", (None, opt.step, None)))
    if opt.checkpoint:
        rows.append(Row(f"checkpoint transients ({opt.checkpoint_where})", (None, None, opt.checkpoint)))
    return rows


def plan_memory(cfg: Config, world_size: int, device: DeviceSpec, trace: bool | str = "auto",
                label: str = "") -> MemoryPlan:
    """The plan of ``cfg`` on ``world_size`` ranks of ``device``. ``trace``: True = always trace
    the forward/backward; "auto" = only when the closed-form bound does not already fit."""
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
    plan = MemoryPlan(label or cfg.run_name, device, world_size, t.micro_batch_size, accum,
                      cfg.data.seq_len, "bf16" if bf16 else "fp32", t.activation_checkpointing,
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
                           activation_checkpointing=t.activation_checkpointing, accum=accum,
                           on_gpu=device.on_gpu)
    return replace(plan, rows=_rows(fb.params, opt, fb, bf16), traced=True)
