"""The learning-rate policy of TorchRec's DLRM example: warm up, hold, decay, hold."""

from __future__ import annotations

import torch

__all__ = ["RateSchedule"]

FLOOR = 1e-7  # the decay ends here, not at 0, as TorchRec's DLRM example's does


class RateSchedule:
    """Sets every parameter group's rate for a training step, from its base ``rate``.

    With ``warmup`` steps the rates rise linearly to their base values (step ``s``
    trains at ``(s + 1) / warmup`` of them); from step ``decay_start`` they fall
    quadratically over ``decay_steps`` steps to ``FLOOR``, where they stay. A
    function of the step alone, so a resumed run continues the schedule exactly.
    The embedding tables' fused optimizer takes the rates at its next
    ``zero_grad``, at the start of the step, as the dense one does.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        rate: float,
        warmup: int,
        decay_start: int,
        decay_steps: int,
    ) -> None:
        self._groups = optimizer.param_groups
        self._base = rate  # not the groups' rates: a resumed optimizer holds scheduled ones
        self.warmup, self.decay_start, self.decay_steps = warmup, decay_start, decay_steps

    @property
    def active(self) -> bool:
        return bool(self.warmup or self.decay_steps)

    def scale(self, step: int) -> float:
        """The share of the base rates that step ``step`` (from 0) trains at."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay_steps and step >= self.decay_start:
            left = max(0, self.decay_start + self.decay_steps - step)
            return (left / self.decay_steps) ** 2
        return 1.0

    def set(self, step: int) -> None:
        """Give every group its rate for step ``step``."""
        rate = self._base * self.scale(step)
        for group in self._groups:
            group["lr"] = max(FLOOR, rate) if self.decay_steps else rate
