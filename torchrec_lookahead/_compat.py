"""TorchRec's, FBGEMM's and torch's internals, behind one door.

Every private name, override and patch the project needs is here, each with
why no public API serves; the rest of the project uses public API only, and
reaches these through the base classes and functions below. Checked on
torch 2.13 / FBGEMM 1.8 / TorchRec 1.8 (``requirements/cpu.txt``) and on
torch 2.14.1 / FBGEMM 1.9.0 / TorchRec 1.9.2 (``requirements/compat.txt``,
``make test-compat``): every name below is in both, with the same meaning. On the
lent GPU machine's train, torch 2.11 / FBGEMM 1.6 (CUDA build) / TorchRec 1.6.1, one
differs, and :data:`TBE_TAKES_HOST_BUFFERS` says so. A release that moves one of them
breaks this module alone.
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._python_dispatch import _pop_mode_temporarily as outside_dispatch_mode
from torchrec.distributed.batched_embedding_kernel import (
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection,
    VariableBatchEmbeddingBagCollectionAwaitable,
    construct_output_kt,
)
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import LazyAwaitable, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

__all__ = [
    "DATA_DEPENDENT",
    "ITEM",
    "TBE_TAKES_HOST_BUFFERS",
    "PIN_MEMORY",
    "TO_COPY",
    "UNIQUE",
    "DispatchMode",
    "GatheredOutput",
    "CompletedOutput",
    "LookupBase",
    "FusedKernelBase",
    "FusedOptimizerBase",
    "FusedSequenceKernelBase",
    "SequenceLookupBase",
    "ShardedCollectionBase",
    "ShardedSequenceCollectionBase",
    "embedding_features",
    "fake_cuda_tensors",
    "fake_store",
    "has_fake_kernel",
    "in_backward_optimizers",
    "is_fake",
    "outside_dispatch_mode",
    "observe_collectives",
    "op_schema",
    "real_tensors",
    "sharded_tensor_from_shards",
    "split_pooled_tables",
]


# FBGEMM 1.8 added the TBE's ``preallocated_host_buffers`` (a disk store under DMP hands
# it the store's mapped files as the TBE's host memory); 1.6, the release beside the lent
# GPU machine's torch 2.11, lacks it.
TBE_TAKES_HOST_BUFFERS = (
    "preallocated_host_buffers"
    in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
)

# ------------------------------------------------------------ unsharded modules


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


# ------------------------------------------------------------ FBGEMM's TBE


def split_pooled_tables(
    tbe: SplitTableBatchedEmbeddingBagsCodegen,
    feature_tables: Sequence[int],
    feature_pools: Sequence[int],
    slots: Sequence[int],
) -> None:
    """Make FBGEMM update a pool's tables as the separate tables they are in TorchRec.

    FBGEMM finds a TBE's tables from ``hash_size_cumsum`` (one entry per
    feature; features with equal entries share a table) and their storage from
    ``weights_offsets``. A pool is one table of slots, so its tables' features
    would look like features of one shared table, and the CPU update of a
    shared table takes another path (for ``EXACT_ROWWISE_ADAGRAD`` one that
    rounds differently). Here each of the group's tables gets its own entry,
    as wide as its pool, while its features still read and write the pool's
    slots: the update then runs per table exactly as plain TorchRec's does.
    FBGEMM has no constructor argument for this (its table map is the storage
    map), so the buffers it derives from the map are rewritten.
    """
    if getattr(tbe, "enable_raw_embedding_streaming", False):
        raise ValueError(
            "raw embedding streaming (FBGEMM) is not supported with lookahead "
            "caching: it keeps state built from the table map this rewrites"
        )
    entries, total, last = [], 0, None
    for table, pool in zip(feature_tables, feature_pools):
        if last is not None and table != last[0]:
            total += slots[last[1]]
        entries.append(total)
        last = (table, pool)
    total += slots[last[1]] if last is not None else 0
    device = tbe.hash_size_cumsum.device
    tbe.hash_size_cumsum = torch.tensor(entries + [total], dtype=torch.int64, device=device)
    tbe.total_hash_size = total
    tbe.total_hash_size_bits = int(math.log2(total) + 1) if total else 0


# ------------------------------------------------------------ TorchRec's sharded collection


if TYPE_CHECKING:
    # The mixins below read TorchRec's private attributes of the class they are mixed into
    # (Any to mypy, as TorchRec's classes are here).
    _TorchRecPart = Any
else:
    _TorchRecPart = object


class _FusedKernelParts(_TorchRecPart):
    """TorchRec's fused kernels (pooled and sequence), read through properties: they keep
    their TBE and their shard's layout in private attributes only (``_emb_module``,
    ``_local_rows``, ``_local_cols``, ``_feature_table_map``)."""

    @property
    def store_tbe(self) -> SplitTableBatchedEmbeddingBagsCodegen:
        return self._emb_module

    @property
    def local_rows(self) -> list[int]:
        return list(self._local_rows)

    @property
    def local_cols(self) -> list[int]:
        return list(self._local_cols)

    @property
    def feature_table_map(self) -> list[int]:
        return list(self._feature_table_map)

    def use_fused_optimizer(self, optimizer: EmbeddingFusedOptimizer) -> None:
        """Make ``optimizer`` this kernel's ``fused_optimizer`` (TorchRec returns its
        private ``_optim`` there and has no setter)."""
        self._optim = optimizer


class FusedKernelBase(_FusedKernelParts, BatchedFusedEmbeddingBag):
    """TorchRec's fused kernel of pooled tables (``EmbeddingBagCollection``'s)."""

    @property
    def pooling(self) -> Any:
        return self._pooling


class FusedSequenceKernelBase(_FusedKernelParts, BatchedFusedEmbedding):
    """TorchRec's fused kernel of sequence tables (``EmbeddingCollection``'s: one row per
    id, FBGEMM's pooling ``NONE``), built with the pooled kernel's arguments (it takes no
    sharding type or environment)."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        super().__init__(config, pg, device)

    @property
    def pooling(self) -> Any:
        return PoolingMode.NONE


class FusedOptimizerBase(EmbeddingFusedOptimizer):
    """TorchRec's fused optimizer with a hook before its state is read (``state`` is a
    plain attribute there, ``_state`` behind it, which ``state_dict`` and
    ``CombinedOptimizer`` read)."""

    def before_state_read(self) -> None:
        """Called whenever the optimizer state is read."""

    @property
    def state(self) -> Any:
        self.before_state_read()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value


class _LookupParts(_TorchRecPart):
    """TorchRec's lookups whose kernels are made by ``make_kernel``: they have no public
    hook, only the private ``_create_embedding_kernel`` they call per group."""

    def make_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> Any:
        raise NotImplementedError

    @property
    def kernels(self) -> list[Any]:
        return list(self._emb_modules)

    def kernel_features(self, features: Any) -> list[Any]:
        """The features each kernel's forward will get (as ``forward`` splits them)."""
        if not self._emb_modules:
            return []
        return features.split(self._feature_splits)


class LookupBase(_LookupParts, GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, its kernels made by ``make_kernel``."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> torch.nn.Module:
        return self.make_kernel(config, device, pg, sharding_type, env)


class SequenceLookupBase(_LookupParts, GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup, its kernels made by ``make_kernel`` (its constructor
    takes the pooled lookup's arguments; a sequence lookup has no sharding type)."""

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> torch.nn.Module:
        return self.make_kernel(config, device, pg, None, env)


class _ShardedParts(_TorchRecPart):
    """TorchRec's sharded collections (pooled and sequence) with the hooks they lack
    publicly.

    * ``make_lookup(index, configs, pg, device, sharding_type, env)`` builds the
      lookup of each sharding (TorchRec builds them in ``_create_lookups``).
    * ``use_input_dists(dists)`` gives this thread (the lookahead stage) input
      dists of its own: TorchRec's ``input_dist`` reads ``self._input_dists``,
      so a property answers per thread.
    * ``input_dists_on(pg)``: copies of TorchRec's input dists whose
      collectives run on ``pg`` (its modules hold their group as ``_pg``).
    * ``table_configs()`` and ``sharding_types``: the tables and how they are sharded.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._thread_input_dists = _ThreadValue()
        super().__init__(*args, **kwargs)

    def make_lookup(
        self,
        index: int,
        configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv,
    ) -> Any:
        raise NotImplementedError

    def _shardings(self) -> list[Any]:
        raise NotImplementedError

    def table_configs(self) -> list[Any]:
        raise NotImplementedError

    @property
    def sharding_types(self) -> list[str]:
        raise NotImplementedError

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def lookups(self) -> list[Any]:
        return list(self._lookups)

    def input_dists_on(self, pg: dist.ProcessGroup) -> list[torch.nn.Module]:
        dists = [sharding.create_input_dist() for sharding in self._shardings()]
        for module in (m for d in dists for m in d.modules()):
            if isinstance(getattr(module, "_pg", None), dist.ProcessGroup):
                module._pg = pg
            _called_as_torch_calls(module)
        return dists

    def use_input_dists(self, dists: list[torch.nn.Module] | None) -> None:
        """This thread's input dists from now on (``None`` or empty: TorchRec's own)."""
        self._thread_input_dists.set(dists)

    @property
    def input_dists_ready(self) -> bool:
        """Whether TorchRec has made its input dists (at the first forward or input_dist)."""
        return bool(self.__dict__.get("_trainer_input_dists"))

    @property
    def _input_dists(self) -> list[torch.nn.Module]:
        return self._thread_input_dists.get() or self.__dict__["_trainer_input_dists"]

    @_input_dists.setter
    def _input_dists(self, value: list[torch.nn.Module]) -> None:
        self.__dict__["_trainer_input_dists"] = value

    def _create_input_dist(self, *args: Any, **kwargs: Any) -> None:
        super()._create_input_dist(*args, **kwargs)
        self.input_dists_created()

    def input_dists_created(self) -> None:
        """Called once TorchRec has made its input dists."""


class ShardedCollectionBase(_ShardedParts, ShardedEmbeddingBagCollection):
    """TorchRec's sharded ``EmbeddingBagCollection`` with the hooks of :class:`_ShardedParts`."""

    def _shardings(self) -> list[Any]:
        return list(self._embedding_shardings)

    def table_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._embedding_bag_configs)

    @property
    def sharding_types(self) -> list[str]:
        return list(self.sharding_type_to_sharding_infos)

    def _create_lookups(self) -> None:
        for index, sharding in enumerate(self._embedding_shardings):
            if isinstance(sharding, TwRwPooledEmbeddingSharding):
                configs = sharding._grouped_embedding_configs_per_rank[sharding._rank]
                sharding_type: ShardingType | None = ShardingType.TABLE_ROW_WISE
            else:
                configs = sharding._grouped_embedding_configs
                is_rw = isinstance(sharding, RwPooledEmbeddingSharding)
                sharding_type = ShardingType.ROW_WISE if is_rw else None
            self._lookups.append(
                self.make_lookup(
                    index, configs, sharding._pg, sharding._device, sharding_type, sharding._env
                )
            )


class ShardedSequenceCollectionBase(_ShardedParts, ShardedEmbeddingCollection):
    """TorchRec's sharded ``EmbeddingCollection`` with the hooks of :class:`_ShardedParts`."""

    def _shardings(self) -> list[Any]:
        return list(self._sharding_type_to_sharding.values())

    def table_configs(self) -> list[Any]:
        return list(self._embedding_configs)

    @property
    def sharding_types(self) -> list[str]:
        return list(self._sharding_types)

    def _create_lookups(self) -> None:
        for index, (sharding_type, sharding) in enumerate(self._sharding_type_to_sharding.items()):
            self._lookups.append(
                self.make_lookup(
                    index,
                    sharding._grouped_embedding_configs,
                    sharding._pg,
                    sharding._device,
                    ShardingType(sharding_type),
                    sharding._env,
                )
            )


_AS_TORCH_CALLS: dict[type, type] = {}


def _called_as_torch_calls(module: torch.nn.Module) -> None:
    """Keep torch's own ``__call__`` for ``module``, whatever another thread traces.

    While torch.fx traces a model it swaps ``nn.Module.__call__`` for a recorder
    that refuses modules outside that model, in every thread. The stage calls its
    input dists on its own thread, perhaps while the trainer's thread traces
    (TorchRec's pipelines trace their model at its first batch); its modules
    take a subclass that calls them as torch does.
    """
    cls = type(module)
    if cls not in _AS_TORCH_CALLS:
        _AS_TORCH_CALLS[cls] = type(
            cls.__name__,
            (cls,),
            {"__call__": torch.nn.Module._wrapped_call_impl, "__module__": cls.__module__},
        )
    module.__class__ = _AS_TORCH_CALLS[cls]


class _ThreadValue:
    """A value per thread (``None`` where unset)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> Any:
        return getattr(self._local, "value", None)

    def set(self, value: Any) -> None:
        self._local.value = value


class GatheredOutput(VariableBatchEmbeddingBagCollectionAwaitable):
    """TorchRec's deduplicated output, expanded to the batch by ``gather`` where every
    feature has the same width and the output is on the CPU; otherwise as TorchRec
    expands it. TorchRec's expansion is the private ``_wait_impl`` of its awaitable,
    over the awaitable's private fields; :meth:`adopt` takes over TorchRec's object."""

    gather: Callable[[torch.Tensor, torch.Tensor, Any, int], torch.Tensor]

    @classmethod
    def adopt(cls, output: Any, gather: Callable[..., torch.Tensor]) -> Any:
        """``output`` expanded by ``gather`` if it is TorchRec's deduplicated output
        (the same object, its class swapped: no state is copied)."""
        if type(output) is VariableBatchEmbeddingBagCollectionAwaitable:
            output.__class__ = cls
            output.gather = gather
        return output

    def _wait_impl(self) -> Any:
        dims = self._uncombined_embedding_dims
        if len(set(dims)) != 1 or self._inverse_indices[1].device.type != "cpu":
            return super()._wait_impl()
        embeddings = [awaitable.wait() for awaitable in self._awaitables]
        _, inverse = self._inverse_indices
        if self._inverse_indices_permute_indices is not None:
            inverse = inverse.index_select(0, self._inverse_indices_permute_indices)
        pooled = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings)
        expanded = self.gather(pooled, inverse, self._batch_size_per_feature_pre_a2a, dims[0])
        for awaitable in self._resize_awaitables or []:
            awaitable.wait()
        return construct_output_kt(
            embeddings=[self._permute_op(expanded)],
            embedding_names=self._embedding_names,
            embedding_dims=self._embedding_dims,
        )


class CompletedOutput(LazyAwaitable[Any]):
    """A sharded module's output awaitable, completed by ``complete`` when waited for: a
    module that adds to TorchRec's output (the hot rows' part) still returns one
    awaitable, as TorchRec's sharded modules do. Waiting is TorchRec's private
    ``_wait_impl``, hence here."""

    def __init__(self, output: Any, complete: Callable[[Any], Any]) -> None:
        super().__init__()
        self._output = output
        self._complete = complete

    def _wait_impl(self) -> Any:
        return self._complete(self._output.wait())


# ------------------------------------------------------------ torch.distributed


def data_parallel_parts(model: torch.nn.Module) -> list[tuple[Any, str]]:
    """Every ``DistributedDataParallel`` in ``model`` and what it holds: ``"dense"`` for
    DMP's (the dense layers), ``"data_parallel"`` for those TorchRec's sharded collections
    wrap their data-parallel tables' lookups in (kept in the private ``_lookups`` list,
    which ``modules()`` does not reach)."""
    from torch.nn.parallel import DistributedDataParallel

    found: list[tuple[Any, str]] = []
    for module in model.modules():
        found += [
            (m, "data_parallel")
            for m in getattr(module, "_lookups", [])
            if isinstance(m, DistributedDataParallel)
        ]
        if isinstance(module, DistributedDataParallel):
            found.append((module, "dense"))
    return found


_OBSERVERS: list[torch.library.Library] = []  # registrations live as long as the process


def observe_collectives(
    names: Sequence[str], observer: Callable[[str, tuple[Any, ...]], None]
) -> None:
    """Call ``observer(name, args)`` on the calling thread before every call of the c10d
    operators ``names`` (``"allreduce_"``, ``"send"``, ...) made through the dispatcher
    with autograd on: ``torch.distributed``'s functions, a process group's methods,
    DDP's reducer (not functional collectives, which run below autograd, nor calls made
    under ``torch.inference_mode``).

    It is a kernel of the ``Autograd`` key (``torch.library``; c10d registers none
    there), which calls the observer and then the operator's kernels below autograd:
    ``torch.distributed`` stays as it is, and only these operators pass through Python,
    not every operator of a thread (as a dispatch mode would). The keyset below
    autograd is private to torch. An error in the observer is warned about once and
    the collective still runs (a rank that skipped one would hang the others).
    Register before other threads issue collectives: the dispatcher's table is not
    safe to change while another thread dispatches. The registration lasts until the
    interpreter exits, so call this once per operator.
    """
    library = torch.library.Library("c10d", "IMPL")
    below_autograd = torch._C._after_autograd_keyset
    failed: list[BaseException] = []

    for name in names:
        op = getattr(torch.ops.c10d, name).default

        def kernel(keyset: Any, *args: Any, _op: Any = op, _name: str = name) -> Any:
            try:
                observer(_name, args)
            except Exception as error:
                if not failed:
                    failed.append(error)
                    warnings.warn(f"observing c10d's {_name} failed: {error!r}", stacklevel=2)
            return _op.redispatch(keyset & below_autograd, *args)

        library.impl(name, kernel, "Autograd", with_keyset=True)
    _OBSERVERS.append(library)


def in_backward() -> bool:
    """Whether this thread runs an autograd backward node now (torch tells only through
    the private ``torch._C._current_autograd_node``)."""
    return torch._C._current_autograd_node() is not None


def fake_cuda_tensors() -> Any:
    """torch's ``FakeTensorMode`` (tensors without data, CUDA ones on a CPU build; device
    mismatches raise as on a GPU): the tests check the CUDA path with it. It lives in the
    private ``torch._subclasses``. This one may serve several threads (the pipeline's)."""
    return _PerThreadFakeTensorMode(allow_non_fake_inputs=True)


class _PerThreadFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose ``in_kernel_invocation`` flag is the calling thread's.

    While a fake kernel runs, torch sets the flag on the mode and every fake tensor of
    the mode then reports the ``meta`` device; torch keeps the matching dispatch state per
    thread, but the flag per mode, so another thread's tensors turned ``meta`` meanwhile.
    """

    @property
    def in_kernel_invocation(self) -> bool:
        return bool(getattr(self._flag(), "value", False))

    @in_kernel_invocation.setter
    def in_kernel_invocation(self, value: bool) -> None:
        self._flag().value = value

    def _flag(self) -> threading.local:
        flag = self.__dict__.get("_per_thread")
        if flag is None:
            flag = self.__dict__["_per_thread"] = threading.local()
        return flag


# Checking CUDA code on the CPU (torchrec_lookahead.testing): torch's fake tensors and the
# dispatch of every operator to Python. Neither has a public home: FakeTensorMode lives in
# the private ``torch._subclasses``, TorchDispatchMode (``DispatchMode`` here) in
# ``torch.utils._python_dispatch``, an operator's schema (which arguments it writes) in
# ``OpOverload._schema``.

DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake tensor's operator raises when its output depends on the data."""

# ATen's underscored operators the fake CUDA tool handles itself: the copy every ``.to()``
# comes down to (issued directly: a CPU build's binding of ``.to`` asks the CUDA device guard
# it lacks first), the page-locking copy behind ``pin_memory()`` (emulated: a CPU build has
# no page-locked memory) and ``unique`` (its output's shape depends on the data).
TO_COPY = torch.ops.aten._to_copy.default
PIN_MEMORY = torch.ops.aten._pin_memory.default
UNIQUE = torch.ops.aten._unique2.default
ITEM = torch.ops.aten._local_scalar_dense.default  # what Tensor.item() dispatches to


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (no data; see :func:`fake_cuda_tensors`)."""
    return isinstance(value, FakeTensor)


def real_tensors() -> Any:
    """A block in which no fake tensor mode is active: factories make real tensors."""
    return unset_fake_temporarily()


def op_schema(func: Any) -> Any:
    """An operator's schema: its arguments, and which of them it writes (``alias_info``)."""
    return func._schema


def has_fake_kernel(name: str) -> bool:
    """Whether operator ``name`` (``"namespace::op"``) has a kernel for fake tensors: a
    CUDA build of FBGEMM registers them for its TBE kernels, a CPU build does not."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")


def fake_store() -> Any:
    """torch's store for the ``cuda:fake`` process-group backend (takes CUDA tensors only,
    as NCCL does; no communication), from the private ``torch.testing._internal``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def sharded_tensor_from_shards(shards: list[Shard], like: ShardedTensor) -> ShardedTensor:
    """A ``ShardedTensor`` of ``shards`` with ``like``'s metadata and process group.
    torch has no public constructor from local shards and global metadata, and keeps
    the group as ``_process_group``; ``ShardedTensor`` itself lives in the private
    ``torch.distributed._shard`` (TorchRec's state dicts are made of them)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, like.metadata(), process_group=like._process_group
    )
