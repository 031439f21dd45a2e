"""The communicated density as a pure function of the step (spec §2, line 9).

Geometric warmup from ``s = 1.0`` (dense) to the target ``d`` over ``W`` steps:
``d_t = s·(d/s)^min(1, t/W)``; ``constant`` (or ``W = 0``) gives ``d`` at every step. Being
stateless, the schedule resumes exactly from the step counter alone.
"""

from __future__ import annotations

SCHEDULES = ("geometric", "constant")
START_DENSITY = 1.0


def density_at(step: int, target: float, warmup_steps: int = 0,
               schedule: str = "geometric") -> float:
    """Density ``d_step`` for step ``step`` (``d_0 = 1`` under a geometric warmup)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {target}")
    if schedule not in SCHEDULES:
        raise ValueError(f"density_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"density_warmup_steps must be >= 0, got {warmup_steps}")
    if schedule == "constant" or warmup_steps == 0:
        return target
    frac = min(1.0, max(step, 0) / warmup_steps)
    return START_DENSITY * (target / START_DENSITY) ** frac


def segment_k(numel: int, density: float) -> int:
    """Entries kept in a segment of ``numel`` elements: ``max(1, floor(d·numel))``, at most all."""
    return min(numel, max(1, int(density * numel)))
