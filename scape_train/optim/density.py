"""The communicated density as a pure function of the step (spec §2, line 9).

Indexed by the step at which a mask is used. Three phases, each optional:

- dense phase, steps ``t < t0`` (``start_step``): density 1, i.e. plain data-parallel AdamS
  (every residual zero, all-ones masks);
- warm-up from ``s = 1.0`` to the target ``d`` over ``W`` steps on ``u = t - t0 + 1`` (so that
  ``t0`` is the first sparse step; ``t0`` of 0 or 1 both mean no dense phase), geometric
  ``s·(d/s)^min(1, u/W)`` or linear ``s + (d-s)·min(1, u/W)`` (``constant`` or ``W = 0``: ``d``);
- cooldown over the last ``C`` steps of a ``T``-step run: geometric from ``d`` back to 1.0,
  ``d·(1/d)^(v/C)`` with ``v = t - (T - C)``, so the last step sends everything and flushes the
  residuals. Where it overlaps the warm-up the larger density wins.

Being stateless, the schedule resumes exactly from the step counter alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("geometric", "linear", "constant")
START_DENSITY = 1.0


@dataclass(frozen=True)
class DensitySchedule:
    target: float
    warmup_steps: int = 0
    shape: str = "geometric"
    start_step: int = 0          # t0: steps before it are dense data-parallel AdamS
    cooldown_steps: int = 0      # C: the last C steps rise back to density 1
    total_steps: int = 0         # T: the run's length (the cooldown is placed from its end)

    def __post_init__(self):
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.target}")
        if self.shape not in SCHEDULES:
            raise ValueError(f"density_schedule must be one of {SCHEDULES}, got {self.shape!r}")
        for name in ("warmup_steps", "start_step", "cooldown_steps", "total_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"density {name} must be >= 0, got {getattr(self, name)}")
        if self.cooldown_steps and self.total_steps < self.cooldown_steps:
            raise ValueError(f"a density cooldown of {self.cooldown_steps} steps needs the run's "
                             f"length (total_steps={self.total_steps}) to be at least as long")

    @classmethod
    def of(cls, cfg, total_steps: int = 0) -> "DensitySchedule":
        """The schedule an :class:`~scape_train.optim.config.OptimizerConfig` describes."""
        return cls(cfg.density, cfg.density_warmup_steps, cfg.density_schedule,
                   cfg.density_start_step, cfg.density_cooldown_steps, total_steps)

    def dense(self, step: int) -> bool:
        """Whether ``step`` is in the dense phase (before the start step)."""
        return step < self.start_step

    def at(self, step: int) -> float:
        """Density ``d_step`` of the mask used at ``step``."""
        if self.dense(step):
            return START_DENSITY
        d = self._ramp(step - max(self.start_step, 1) + 1)
        if self.cooldown_steps:
            into = step - (self.total_steps - self.cooldown_steps)
            if into > 0:
                frac = into / self.cooldown_steps
                d = START_DENSITY if frac >= 1.0 else max(
                    d, self.target * (START_DENSITY / self.target) ** frac)
        return d

    def peak(self) -> float:
        """The largest density of the run (the warm-up falls, the cooldown rises)."""
        last = self.total_steps if self.cooldown_steps else 1
        return max(self.at(1), self.at(last))

    def changing_steps(self) -> list[int]:
        """The steps whose density can differ from the one before: the dense phase and the
        warm-up, then the cooldown; every density of the run is one of theirs."""
        head = range(1, self.start_step + self.warmup_steps + 2)
        tail = range(max(head.stop, self.total_steps - self.cooldown_steps + 1),
                     self.total_steps + 1) if self.cooldown_steps else range(0)
        return [*head, *tail]

    def _ramp(self, u: int) -> float:
        d, s = self.target, START_DENSITY
        if self.shape == "constant" or self.warmup_steps == 0:
            return d
        frac = min(1.0, max(u, 0) / self.warmup_steps)
        if frac >= 1.0:
            return d  # the ramp ends at the target itself, not one rounding away from it
        if self.shape == "linear":
            return s + (d - s) * frac
        return s * (d / s) ** frac


def density_at(step: int, target: float, warmup_steps: int = 0,
               schedule: str = "geometric") -> float:
    """Density of the warm-up alone (no start step, no cooldown): ``DensitySchedule.at``."""
    return DensitySchedule(target, warmup_steps, schedule).at(step)


# A density the schedule computes (a ramp's subtraction, product and sum; a power) lies a few ulps
# (2^-52 relative each) off its exact value; 2^-40 covers any such chain thousands of times over.
# At 2^31 elements, the most a segment holds, it moves the product by under 2^-9 of one element.
K_TOLERANCE = 2.0 ** -40


def segment_k(numel: int, density: float) -> int:
    """Entries kept in a segment of ``numel`` elements: ``max(1, floor(d·numel))``, at most all.

    The spec (scape.md, line 8): "``k = max(1, floor(d_{t+1}·numel_segment))``", a floor in exact
    arithmetic. In binary floating point ``0.29 * 100`` is ``28.999999999999996`` and a linear
    ramp's ``1 - 0.9·0.4`` is ``0.6399999999999999``: truncation would keep one fewer. So the
    product is floored with a relative tolerance of :data:`K_TOLERANCE`: a product within it below
    an integer is that integer. The tolerance (rather than exact arithmetic on the density's
    decimal repr) also holds for computed densities whose exact value has no short decimal (a
    ramp step of ``u/7``). A pure host-side function: every rank and path gets the same k."""
    return min(numel, max(1, math.floor(density * numel * (1.0 + K_TOLERANCE))))
