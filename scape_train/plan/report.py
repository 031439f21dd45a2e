"""The plan as text: the component table, the device line, the verdict and the fix."""

from __future__ import annotations

from scape_train.plan.devices import GiB
from scape_train.plan.estimate import PHASES, MemoryPlan
from scape_train.plan.fixes import Fix

HEADS = ("fwd/bwd", "opt step", "checkpoint")


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    accum = f", {plan.accum} accumulation steps" if plan.accum > 1 else ""
    how = ("activations traced on fake tensors" if plan.traced
           else "activations from the closed-form upper bound (fits even so; no trace needed)")
    lines = [f"memory plan: {plan.label} on {plan.world_size} rank(s) of {plan.device.name}; "
             f"micro-batch {plan.micro_batch_size} x {plan.seq_len} tokens{accum}, {plan.precision}, "
             f"activation checkpointing {plan.activation_checkpointing}",
             f"({how}; GiB per rank)"]
    lines += [f"({note})" for note in plan.notes]
    width = max(len(r.name) for r in plan.rows) + 2
    lines.append(f"{'component':<{width}}" + "".join(f"{h:>12}" for h in HEADS))
    for row in plan.rows:
        lines.append(f"{row.name:<{width}}" + "".join(f"{_gib(c):>12}" for c in row.cells))
    lines.append(f"{'total':<{width}}" + "".join(f"{_gib(t):>12}" for t in plan.totals()))
    if plan.host:
        held = ", ".join(f"{name} {_gib(b)} GiB" for name, b in plan.host)
        lines.append(f"host memory per rank instead of the device: {held}")
    d = plan.device
    note = f", {d.note}" if d.note else ""
    lines.append(f"device: {d.name}{note}: {_gib(d.capacity)} GiB, usable {_gib(d.usable)} GiB "
                 f"(minus {_gib(d.reserve)} GiB reserve, then {d.fragmentation:.0%} fragmentation margin)")
    sign = "<=" if plan.fits else ">"
    lines.append(f"verdict: {'fits' if plan.fits else 'does NOT fit'}: peak {_gib(plan.peak)} GiB "
                 f"({plan.peak_phase}) {sign} {_gib(d.usable)} GiB usable")
    return "\n".join(lines)


def format_fix(plan: MemoryPlan, fix: Fix | None) -> str:
    if plan.fits:
        return ""
    if fix is None:
        return ("No change tried fits (activation checkpointing, smaller micro-batches with "
                "accumulation, SCAPE offload/sharding): use a larger device or a smaller model/sequence")
    return (f"Smallest change that fits: {fix.overrides}  "
            f"(peak {_gib(fix.plan.peak)} GiB, {fix.plan.peak_phase}, of {_gib(fix.plan.device.usable)} usable)")


assert len(HEADS) == len(PHASES)
