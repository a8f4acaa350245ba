"""The host check of a pipeline's batches, made where they are read: in a ``DataLoader``'s
worker processes, if it has them.

The lookahead stage refuses a batch whose structure is broken, that names a feature no
embedding module knows, or that holds an id outside its cached table
(:func:`~torchrec_lookahead.checks.check_batch`), before the batch reaches the device or
changes any state. The check reads every id of the batch. By default the stage's
reading thread makes it. A loader with worker processes can make it instead, beside
its reading and collating, off every thread of the training process::

    check = BatchCheck.of(model)  # the model as the pipeline gets it (after DMP)
    loader = DataLoader(dataset, batch_size=None, num_workers=4, collate_fn=check.collate())
    pipeline = LookaheadTrainPipeline(model, optimizer, device)

Such a loader's batches reach the stage as :class:`CheckedBatch`\\ es carrying the
worker's verdict, which the stage takes instead of checking again: a refused batch is
refused in its place, with the message the stage's own check gives. A batch checked for
another model (other features or table sizes) stops the stage, with an error that says
so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.data import default_convert

from torchrec_lookahead._compat import embedding_features, feature_rows
from torchrec_lookahead.checks import check_batch
from torchrec_lookahead.steps import LookaheadModule

__all__ = ["BatchCheck", "CheckedBatch"]

# The step a refusal's message names, until the stage knows it: a batch is checked
# before it is planned (in a worker, or on the reading thread, which runs ahead), and a
# batch refused on any rank takes no step.
UNNAMED_STEP = "step \x00"


@dataclass(frozen=True)
class BatchCheck:
    """What the stage checks of a model's batches on the host: a picklable value, the
    same in a loader's worker as in the training process.

    Args:
        features: every feature some embedding module of the model looks up, and
            whether that module is weighted.
        rows: each feature of a lookahead module, the rows of its table.
    """

    features: Mapping[str, bool]
    rows: Mapping[str, int]

    @classmethod
    def of(cls, model: torch.nn.Module) -> BatchCheck:
        """The check of ``model``'s batches, as :class:`LookaheadTrainPipeline` makes it
        (``model`` as the pipeline gets it: under DMP, the wrapped model)."""
        features: dict[str, bool] = {}
        for module in model.modules():
            for feature, weighted in (embedding_features(module) or {}).items():
                features[feature] = features.get(feature, False) or weighted
        rows = {
            feature: count
            for module in model.modules()
            if isinstance(module, LookaheadModule)
            for feature, count in feature_rows(module).items()
        }
        return cls(features, rows)

    def refusal(self, batch: Any) -> ValueError | None:
        """Why ``batch`` is refused (its message naming :data:`UNNAMED_STEP`), if it is."""
        try:
            check_batch(batch, self.features, UNNAMED_STEP, self.rows)
        except ValueError as refused:
            return refused
        return None

    def collate(self, collate_fn: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
        """A ``collate_fn`` for a ``DataLoader``: ``collate_fn`` (default: ``DataLoader``'s
        own for ``batch_size=None``, which hands each batch on as it is), then this
        check, in the process that collates; it returns :class:`CheckedBatch`\\ es."""
        return partial(_collate_and_check, self, collate_fn or default_convert)


@dataclass
class CheckedBatch:
    """A batch with the verdict of the check it passed or failed."""

    batch: Any
    check: BatchCheck
    refusal: ValueError | None


def _collate_and_check(
    check: BatchCheck, collate_fn: Callable[[Any], Any], samples: Any
) -> CheckedBatch:
    batch = collate_fn(samples)
    return CheckedBatch(batch, check, check.refusal(batch))
