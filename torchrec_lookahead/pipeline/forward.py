"""A step's context handed to each lookahead module through its forward.

TorchRec's pipelines give a sharded module the state of the batch it runs
(its distributed input, its context) by standing in for the module's
``forward`` (``PipelinedForward``), not by setting that state on the module
from outside. :class:`StepForward` does the same for the lookahead modules:
while the pipeline runs a step's forward, a lookahead module's forward is its
``step_forward(context, ...)``, with that step's
:class:`~torchrec_lookahead.steps.StepContext`; at any other time (an eval
forward, a forward of the user's own) it is the module's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchrec_lookahead.steps import LookaheadModule, StepContext

__all__ = ["StepForward"]


class StepForward:
    """Stands in for ``module``'s forward while a pipeline drives it (``install``, until
    ``restore``); ``running`` says which step's forward the pipeline is in, if any."""

    def __init__(self, module: LookaheadModule, running: Callable[[], StepContext | None]) -> None:
        self._module = module
        self._running = running
        self._own = vars(module).get("forward")  # an instance's own forward, kept to restore

    @classmethod
    def install(
        cls, module: LookaheadModule, running: Callable[[], StepContext | None]
    ) -> StepForward:
        """Stand in for ``module``'s forward (as TorchRec's pipelines set theirs)."""
        forward = cls(module, running)
        _as_module(module).forward = forward
        return forward

    def restore(self) -> None:
        """Give the module its forward back (idempotent)."""
        module = _as_module(self._module)
        if vars(module).get("forward") is not self:
            return
        if self._own is None:
            del module.forward
        else:
            module.forward = self._own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = self._running()
        if context is None:  # not a step of the pipeline's: the module's own forward
            module = _as_module(self._module)
            own = self._own or type(module).forward.__get__(module)
            return own(*args, **kwargs)
        return self._module.step_forward(context, *args, **kwargs)


def _as_module(module: LookaheadModule) -> torch.nn.Module:
    assert isinstance(module, torch.nn.Module), "a lookahead module is a torch module"
    return module
