"""TorchRec's embedding modules, sharded or not: their tables, features, in-backward optimizers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "embedding_features",
    "feature_rows",
    "in_backward_optimizers",
]


def in_backward_optimizers(param: torch.Tensor) -> tuple[list[type], list[dict[str, Any]]]:
    """The optimizer classes and keyword arguments ``apply_optimizer_in_backward`` set on
    ``param``. TorchRec keeps them only as the parameter's ``_optimizer_classes`` and
    ``_optimizer_kwargs`` (its own sharders read them there too)."""
    return list(getattr(param, "_optimizer_classes", [])), list(
        getattr(param, "_optimizer_kwargs", [])
    )


def embedding_features(module: torch.nn.Module) -> dict[str, bool] | None:
    """The features ``module`` looks up and whether it is weighted, if it is an embedding
    module, sharded or not."""
    configs = _embedding_configs(module)
    if configs is None:
        return None
    weighted = getattr(module, "is_weighted", None)
    is_weighted = bool(weighted() if callable(weighted) else getattr(module, "_is_weighted", False))
    return {f: is_weighted for config in configs for f in config.feature_names}


def feature_rows(module: torch.nn.Module) -> dict[str, int]:
    """The row count of the table each feature of ``module`` (an embedding module, sharded
    or not) looks up; empty for any other module."""
    configs = _embedding_configs(module) or []
    return {f: config.num_embeddings for config in configs for f in config.feature_names}


def _embedding_configs(module: torch.nn.Module) -> Sequence[Any] | None:
    """An embedding module's table configs. Sharded collections have no public accessor for
    them (``_embedding_bag_configs``, ``_embedding_configs``, and ``_is_weighted`` for their
    weighting); unsharded ones do, and are read through it."""
    for getter in ("embedding_bag_configs", "embedding_configs"):
        public = getattr(module, getter, None)
        if callable(public):
            return public()
        if isinstance(getattr(module, f"_{getter}", None), list):
            return getattr(module, f"_{getter}")
    return None
