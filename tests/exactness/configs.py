"""The configurations the differential harness draws: every setting the project promises
to train exactly like plain TorchRec, combined at random: bag tables
(``EmbeddingBagCollection``), sequence tables (``EmbeddingCollection``), or both.

A configuration is a pure function of ``(seed, index)``, so any one of them can
be run again alone (``EXACTNESS_SEED=S EXACTNESS_ONLY=k make exactness``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from torchrec_lookahead._compat import TBE_TAKES_HOST_BUFFERS

__all__ = ["EVENTS", "OPTIMIZERS", "Config", "TableSpec", "draw"]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # what FBGEMM's CPU TBE runs
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
ROWS = (1, 2, 3, 5, 8, 20, 60, 300, 2_000, 20_000, 100_000)
ROWS_P = np.array([6, 5, 4, 4, 3, 3, 3, 2, 2, 1, 1], dtype=float)
# Mid-run events: an eval forward; a checkpoint resumed into a new model; the pipeline
# closed and another attached; a checkpoint of an earlier step loaded while the pipeline
# runs; a batch with a bad id on one rank (refused on every rank).
EVENTS = ("eval", "resume", "reattach", "reload", "refuse")
SEQUENCE_SHARE = 1 / 3  # of configurations, with sequence tables
MIXED_SHARE = 2 / 3  # of those of two tables or more, with bag tables too (a half of all)
# A sequence table's sharding for a bag table's: TorchRec shards an EmbeddingCollection
# table-, column- or row-wise only.
SEQUENCE_SHARDING = {"table_row_wise": "row_wise", "table_column_wise": "column_wise"}


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    sharding: str
    optimizer: str
    lr: float
    multi_hot: bool  # bags of 0 to several ids (else one id per bag, as Criteo's)
    data_type: str = "FP32"  # a torchrec DataType's value: "FP32" or "FP16"
    sequence: bool = False  # a sequence table (EmbeddingCollection, unpooled), else a bag table


@dataclass(frozen=True)
class Config:
    seed: int
    index: int
    world_size: int
    tables: tuple[TableSpec, ...]
    pooling: str  # "sum" or "mean"
    weighted: bool
    batch: int  # per rank
    steps: int
    cache_load_factor: float
    lookahead: int
    prefetch_distance: int
    hot: str  # "off", "on" (rows seen often), "budget" (the planner's, within a budget)
    dedup: bool  # the first feature of each table deduplicated over sessions of 4 samples
    disk_store: bool
    schedule: str  # "none", "warmup_decay", "random" (a new rate every step)
    events: tuple[tuple[int, str], ...]  # (after step, event)
    stage_thread: bool
    # Where plans are made (WindowSettings.planner): "device" plans on CPU tensors.
    planner: str = "host"
    # The host planner's hash partitions per pool, each planned on a thread of its own.
    planning_workers: int = 1
    # The caches start at the load factor, with no floor for the widest window, and the
    # first third of the steps' batches are a quarter the size: the caches grow mid-run.
    grow: bool = False

    @property
    def features(self) -> list[str]:
        return [f for t in self.tables for f in t.features]

    @property
    def bags(self) -> tuple[TableSpec, ...]:
        """The bag tables (pooled: the EmbeddingBagCollection's)."""
        return tuple(t for t in self.tables if not t.sequence)

    @property
    def sequences(self) -> tuple[TableSpec, ...]:
        """The sequence tables (unpooled: the EmbeddingCollection's)."""
        return tuple(t for t in self.tables if t.sequence)

    @property
    def tolerance(self) -> float:
        """0 (bitwise) unless a bag can mix hot and cold ids: its pooled sum is then its
        cold sum plus its hot sum, within rounding of TorchRec's sum."""
        mixed = self.hot != "off" and any(t.multi_hot for t in self.bags)
        return 1e-5 if mixed else 0.0

    def describe(self) -> str:
        tables = ",".join(
            f"{t.rows}x{t.dim}{'x' + str(len(t.features)) if len(t.features) > 1 else ''}"
            f":{''.join(w[0] for w in t.sharding.split('_'))}"
            f":{t.optimizer}@{t.lr:g}{':multi' if t.multi_hot else ''}"
            f"{':' + t.data_type.lower() if t.data_type != 'FP32' else ''}"
            f"{':seq' if t.sequence else ''}"
            for t in self.tables
        )
        kind = ("sequence+bags" if self.bags else "sequence") if self.sequences else ""
        extras = [
            kind,
            f"pool={self.pooling}" if self.pooling != "sum" else "",
            "weighted" if self.weighted else "",
            f"hot={self.hot}" if self.hot != "off" else "",
            "dedup" if self.dedup else "",
            "disk" if self.disk_store else "",
            f"lr={self.schedule}" if self.schedule != "none" else "",
            "inline" if not self.stage_thread else "",
            "planner=device" if self.planner == "device" else "",
            f"workers={self.planning_workers}" if self.planning_workers > 1 else "",
            "grow" if self.grow else "",
            " ".join(f"{e}@{s}" for s, e in self.events),
        ]
        return (
            f"ws={self.world_size} [{tables}] B={self.batch} steps={self.steps} "
            f"clf={self.cache_load_factor:.3g} L={self.lookahead} d={self.prefetch_distance} "
            + " ".join(e for e in extras if e)
        )


def _rows_on_every_rank(rows: int, world_size: int) -> bool:
    """Whether TorchRec's row-wise blocks (``ceil(rows / W)`` rows each) leave no rank
    without rows: the lookahead sharder refuses a plan with an empty shard."""
    return rows > -(-rows // world_size) * (world_size - 1)


def draw(seed: int, index: int, hot_rows: bool = False) -> Config:
    """Configuration ``index`` of the stream drawn from ``seed`` (``hot_rows``: every one
    with replicated hot rows, at 2 or 4 ranks): bag tables, some or all of them then made
    sequence tables; then where it plans."""
    return _with_planner(_with_sequence_tables(_draw_bags(seed, index, hot_rows), hot_rows))


def _with_planner(config: Config) -> Config:
    """``config`` planned on the device (its oracle on CPU tensors) a third of the time,
    unless its tables are in a disk store (which reads ahead from the host's plans);
    planned on the host in 2 or 3 hash partitions a quarter of the rest. From generators
    of their own, so that the rest of the draw is as it was."""
    on_device = np.random.default_rng([config.seed, config.index, 45]).random() < 1 / 3
    if on_device and not config.disk_store:
        return replace(config, planner="device")
    rng = np.random.default_rng([config.seed, config.index, 46])
    if rng.random() < 1 / 4:
        return replace(config, planning_workers=int(rng.integers(2, 4)))
    return config


def _draw_bags(seed: int, index: int, hot_rows: bool) -> Config:
    """The configuration with bag tables only (as the harness drew before it drew sequence
    tables: a seed's configurations without sequence tables are what they were)."""
    rng = np.random.default_rng([seed, index])
    world_size = int(rng.choice([1, 2, 4], p=[0.3, 0.5, 0.2]))
    hot = str(rng.choice(["off", "on", "budget"], p=[0.4, 0.4, 0.2]))
    if hot_rows:
        world_size = max(world_size, 2)
        hot = "budget" if hot == "budget" else "on"
    replicable = hot != "off"
    pooling = "sum" if replicable or rng.random() < 0.75 else "mean"
    weighted = not replicable and rng.random() < 0.25
    shared_dim = int(rng.choice([4, 8, 16]))
    one_optimizer = rng.random() < 0.6
    optimizer, lr = str(rng.choice(OPTIMIZERS)), float(rng.choice([0.02, 0.05, 0.1, 0.3]))
    tables = []
    for t in range(int(rng.integers(1, 5))):
        rows = int(rng.choice(ROWS, p=ROWS_P / ROWS_P.sum()))
        dim = shared_dim if replicable or rng.random() < 0.5 else int(rng.choice([4, 8, 16]))
        shardings = [
            s
            for s in SHARDINGS
            if ("column" not in s or (dim >= 8 and not replicable))
            and ("row" not in s or _rows_on_every_rank(rows, world_size))
        ]
        features = (f"f{t}",) if rng.random() < 0.8 else (f"f{t}a", f"f{t}b")
        tables.append(
            TableSpec(
                name=f"t{t}",
                rows=rows,
                dim=dim,
                features=features,
                sharding=str(rng.choice(shardings)),
                optimizer=optimizer if one_optimizer else str(rng.choice(OPTIMIZERS)),
                lr=lr if one_optimizer else float(rng.choice([0.02, 0.05, 0.1, 0.3])),
                multi_hot=bool(rng.random() < 0.3),
            )
        )
    row_wise_over_gloo = world_size > 1 and any("row" in t.sharding for t in tables)
    # Plain TorchRec takes deduplicated (variable-batch) batches only with the optimizers
    # FBGEMM's variable-batch TBE runs; over gloo not into row-wise shards (no uneven
    # reduce-scatter); this project refuses them with hot rows.
    vbe_optimizers = all(t.optimizer in ("sgd", "rowwise_adagrad") for t in tables)
    dedup = (
        not replicable
        and not weighted
        and not row_wise_over_gloo
        and vbe_optimizers
        and rng.random() < 0.25
    )
    steps = int(rng.integers(10, 31))
    events = sorted(
        (int(rng.integers(1, steps - 2)), str(rng.choice(EVENTS)))
        for _ in range(int(rng.choice([0, 1, 2], p=[0.35, 0.4, 0.25])))
    )
    config = Config(
        seed=seed,
        index=index,
        world_size=world_size,
        tables=tuple(tables),
        pooling=pooling,
        weighted=weighted,
        batch=int(rng.choice([4, 8, 16, 32])),
        steps=steps,
        cache_load_factor=float(np.exp(rng.uniform(np.log(0.01), 0.0))),
        lookahead=int(rng.choice([1, 2, 4, 8, 16])),
        prefetch_distance=int(rng.choice([0, 1, 2])),
        hot=hot,
        dedup=dedup,
        # (drawn alike either way, so the rest of the draw is the same)
        disk_store=bool(rng.random() < 0.2) and TBE_TAKES_HOST_BUFFERS,
        schedule=str(rng.choice(["none", "warmup_decay", "random"], p=[0.5, 0.3, 0.2])),
        events=tuple(dict(events).items()),  # one event per step at most
        stage_thread=bool(rng.random() < 0.7),
    )
    # Growth last too, from a generator of its own, for the same reason: bags of several
    # ids, a first table of hundreds of rows or more and a tenth the load factor, so that
    # windows outgrow what the (smaller) first batches sized.
    growth = np.random.default_rng([seed, index, 44])
    if growth.random() < 0.4:
        first = replace(tables[0], rows=int(growth.choice([300, 2_000, 20_000])))
        config = replace(
            config,
            grow=True,
            tables=tuple(replace(t, multi_hot=True) for t in [first, *tables[1:]]),
            cache_load_factor=max(0.001, config.cache_load_factor / 10),
        )
    if replicable or config.disk_store:  # the replicas and the disk store hold FP32 rows
        return config
    # Data types last, from a generator of their own: a seed's other draws stay as they were.
    types = np.random.default_rng([seed, index, 43])
    fp16 = [types.random() < 0.4 for _ in config.tables]
    if config.dedup and len(set(fp16)) > 1:
        # Plain TorchRec cannot take a variable batch into tables of two data types on the
        # CPU (FBGEMM refuses the output its lookup preallocates for their two TBEs), so
        # a deduplicated configuration's tables share one type: the first table's draw.
        fp16 = [fp16[0]] * len(fp16)
    tables = [replace(t, data_type="FP16") if half else t for t, half in zip(config.tables, fp16)]
    return replace(config, tables=tuple(tables))


def _with_sequence_tables(config: Config, hot_rows: bool) -> Config:
    """``config`` with its tables made sequence tables (a third of configurations): all of
    them, or (half of those) its last ones beside bag tables. From a generator of its own,
    so that the rest of the draw is as it was. What sequence tables do not take is left
    out: deduplicated batches; hot rows (a mixed configuration's bag tables keep theirs,
    and with ``hot_rows`` every sequence configuration is mixed); several widths (an
    ``EmbeddingCollection`` has one: its first table's); table-row- and table-column-wise
    sharding (row- and column-wise instead; column-wise of a width under 8, table-wise)."""
    rng = np.random.default_rng([config.seed, config.index, 45])
    if rng.random() >= SEQUENCE_SHARE:
        return config
    n = len(config.tables)
    mixed = n > 1 and (hot_rows or rng.random() < MIXED_SHARE)
    if hot_rows and not mixed:
        return config
    first = int(rng.integers(1, n)) if mixed else 0  # the sequence tables: tables[first:]
    dim = config.tables[first].dim
    sequences = []
    for t in config.tables[first:]:
        sharding = SEQUENCE_SHARDING.get(t.sharding, t.sharding)
        if sharding == "column_wise" and dim < 8:
            sharding = "table_wise"
        sequences.append(replace(t, dim=dim, sharding=sharding, sequence=True))
    return replace(
        config,
        tables=(*config.tables[:first], *sequences),
        hot=config.hot if mixed else "off",
        dedup=False,
    )
