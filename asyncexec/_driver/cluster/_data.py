"""Ray Data datasets for a run: which are split across the workers, and each rank's part.

``run(fn, datasets={"train": ds}, data_config=DataConfig(...))`` hands every rank its part of
each dataset, read inside ``fn`` with :func:`asyncexec.get_dataset_shard`. A dataset that is
split goes through ``Dataset.streaming_split(n, equal=True, locality_hints=<node of each
rank>)``: one coordinator actor runs the dataset and deals its blocks out to the ranks, so every
rank reads the same number of rows and no row is read by two ranks in an epoch (the remainder
of an uneven split, fewer than ``n`` rows, is left out: ``equal=True`` drops it). A dataset
that is not split is given whole to every rank.

What differs from Ray Train's first executor:

- The splits are made anew for every attempt, for the nodes that the new workers landed on, and
  the previous attempt's coordinators are stopped. Ray Train computed them once and reused them
  after a restart: a coordinator half-way through an epoch, with locality hints for nodes whose
  workers were gone.
- The datasets are checked when ``run()`` is called, before anything starts, and copied: the
  run's execution options are set on the copies, never on the caller's datasets (Ray Train set
  them on a shallow copy that shared the caller's ``DataContext``).
- Nothing blocks the event loop: the splitting runs in a thread.

Ray Data is an optional extra (``asyncexec[data]``): it is imported only when datasets are given.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ..._errors import ConfigurationError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["DataConfig", "make_shards", "release_shards", "validate_datasets"]

_EXTRA_HINT = "install the data extra: pip install 'asyncexec[data]'"


@dataclass(frozen=True)
class DataConfig:
    """Which datasets of a run are split across the workers, and how Ray Data runs them.

    Args:
        datasets_to_split: ``"all"`` (default) or the names of the datasets to split; every
            other dataset is given whole to every rank.
        execution_options: Ray Data ``ExecutionOptions`` for the datasets: one for all, or a
            mapping from dataset name to options (the others get the default). The default
            is a copy of the driver's ``DataContext.execution_options`` (resource limits,
            order, progress, label selector) as they are when ``run()`` is called.
        enable_shard_locality: give the split the node of each rank, so that blocks are dealt
            to ranks on the node that holds them.

    Subclasses may override :meth:`configure` to assign the parts differently, as with Ray
    Train's ``DataConfig``.

    Raises:
        ConfigurationError: ``datasets_to_split`` is neither ``"all"`` nor a sequence of names,
            or ``execution_options`` is a mapping with keys that are not names.
    """

    datasets_to_split: Literal["all"] | Sequence[str] = "all"
    execution_options: Any = None
    enable_shard_locality: bool = True

    def __post_init__(self) -> None:
        split = self.datasets_to_split
        if isinstance(split, str):
            if split != "all":
                raise ConfigurationError(
                    f'datasets_to_split must be "all" or a list of dataset names, got '
                    f"{split!r} (for one dataset, write [{split!r}])"
                )
        elif isinstance(split, Sequence) and all(isinstance(n, str) for n in split):
            object.__setattr__(self, "datasets_to_split", tuple(split))
        else:
            raise ConfigurationError(
                f'datasets_to_split must be "all" or a list of dataset names, got {split!r}'
            )
        options = self.execution_options
        if isinstance(options, Mapping):
            bad = [k for k in options if not isinstance(k, str)]
            if bad:
                raise ConfigurationError(
                    f"execution_options maps dataset names to options; bad keys: {bad!r}"
                )
            object.__setattr__(self, "execution_options", dict(options))
        if not isinstance(self.enable_shard_locality, bool):
            raise ConfigurationError(
                f"enable_shard_locality must be a bool, got {self.enable_shard_locality!r}"
            )

    def split_names(self, names: Sequence[str]) -> set[str]:
        """The names among ``names`` that are split."""
        if self.datasets_to_split == "all":
            return set(names)
        return set(self.datasets_to_split) & set(names)

    def configure(
        self,
        datasets: Mapping[str, Any],
        world_size: int,
        worker_handles: Sequence[ActorHandle[Any]] | None,
        worker_node_ids: Sequence[str] | None,
    ) -> list[dict[str, Any]]:
        """Each rank's parts, in rank order: ``{name: DataIterator}``. Called once per attempt,
        in a thread (it may block), with the datasets that ``run()`` prepared.

        Args:
            datasets: the run's datasets by name (copies with their execution options set).
            world_size: how many ranks.
            worker_handles: each rank's actor.
            worker_node_ids: each rank's node id.
        """
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        to_split = self.split_names(list(datasets))
        hints = list(worker_node_ids) if self.enable_shard_locality and worker_node_ids else None
        for name, ds in datasets.items():
            if name in to_split:
                parts = ds.streaming_split(world_size, equal=True, locality_hints=hints)
                for rank, part in enumerate(parts):
                    output[rank][name] = part
            else:
                for rank in range(world_size):
                    output[rank][name] = ds.iterator()
        return output


class _Datasets(dict[str, Any]):
    """A run's prepared datasets, and the split coordinators of its latest attempt (so that the
    next attempt, or the end of the run, can stop them)."""

    coordinators: list[Any]

    def __init__(self, items: Mapping[str, Any]) -> None:
        super().__init__(items)
        self.coordinators = []

    def __reduce__(self) -> tuple[Any, ...]:
        # Never ship the coordinator handles along: a copy is a plain mapping of datasets.
        return (dict, (dict(self),))


def _import_dataset_types() -> tuple[type[Any], type[Any]]:
    try:
        from ray.data import Dataset, ExecutionOptions
    except ImportError as exc:
        raise ConfigurationError(
            f"datasets need Ray Data, which cannot be imported ({exc}); {_EXTRA_HINT}"
        ) from exc
    return Dataset, ExecutionOptions


def validate_datasets(datasets: Any, data_config: Any) -> tuple[dict[str, Any], DataConfig]:
    """Check a run's datasets and data config when ``run()`` is called, and prepare them.

    The datasets are copied (the caller's are never changed), each named after its key when it
    has no name, and given its execution options.

    Args:
        datasets: a mapping of names to Ray Data ``Dataset``.
        data_config: a :class:`DataConfig`, or None for the default (split every dataset).

    Returns:
        The prepared datasets and the data config.

    Raises:
        ConfigurationError: Ray Data is not installed, ``datasets`` is not a mapping of names to
            Ray Data datasets, ``data_config`` is not a DataConfig, or it names datasets that
            were not given.
    """
    if data_config is None:
        data_config = DataConfig()
    elif not isinstance(data_config, DataConfig):
        raise ConfigurationError(
            f"data_config must be an asyncexec.DataConfig, got {type(data_config).__name__}"
        )
    if not isinstance(datasets, Mapping):
        raise ConfigurationError(
            f"datasets must be a mapping of names to Ray Data datasets, got "
            f"{type(datasets).__name__}"
        )
    dataset_type, options_type = _import_dataset_types()
    bad_keys = [k for k in datasets if not isinstance(k, str) or not k]
    if bad_keys:
        raise ConfigurationError(f"dataset names must be non-empty strings, got {bad_keys!r}")
    bad = {k: type(v).__name__ for k, v in datasets.items() if not isinstance(v, dataset_type)}
    if bad:
        detail = ", ".join(f"{k!r} is a {t}" for k, t in bad.items())
        raise ConfigurationError(f"datasets must be Ray Data datasets (ray.data.Dataset): {detail}")
    known = ", ".join(sorted(datasets))
    if data_config.datasets_to_split != "all":
        missing = [n for n in data_config.datasets_to_split if n not in datasets]
        if missing:
            raise ConfigurationError(
                f"DataConfig.datasets_to_split names datasets that were not given: {missing!r} "
                f"(datasets: {known})"
            )
    options = data_config.execution_options
    if isinstance(options, dict):
        missing = [n for n in options if n not in datasets]
        if missing:
            raise ConfigurationError(
                f"DataConfig.execution_options names datasets that were not given: {missing!r} "
                f"(datasets: {known})"
            )
        wrong = [n for n, o in options.items() if not isinstance(o, options_type)]
    else:
        wrong = [] if options is None or isinstance(options, options_type) else ["(all)"]
    if wrong:
        raise ConfigurationError(
            f"DataConfig.execution_options must be ray.data.ExecutionOptions (or a mapping of "
            f"dataset names to them); wrong for {wrong!r}"
        )
    prepared = _Datasets({name: _prepare(name, ds, data_config) for name, ds in datasets.items()})
    return prepared, data_config


def _execution_options(name: str, config: DataConfig) -> Any:
    options = config.execution_options
    if isinstance(options, dict):
        options = options.get(name)
    if options is None:
        from ray.data import DataContext

        # Ray Train's default: what the driver's DataContext says now. The whole options object
        # is copied (not rebuilt field by field, which would pass the deprecated
        # exclude_resources and drop label_selector).
        options = DataContext.get_current().execution_options
    # A copy per dataset: the caller's options object (or the driver's) is never shared.
    return copy.deepcopy(options)


def _prepare(name: str, ds: Any, config: DataConfig) -> Any:
    from ray.data import Dataset

    # A deep copy has its own DataContext, so setting options here leaves the caller's dataset
    # (and every dataset that shares its context) untouched. No Ray call: cheap on the loop.
    prepared = Dataset.copy(ds, _deep_copy=True)
    if prepared.name is None:
        prepared.set_name(name)
    prepared.context.execution_options = _execution_options(name, config)
    return prepared


def _coordinators(shards: Any) -> list[Any]:
    """The split coordinator actors behind the parts (Ray Data's streaming split keeps its
    handle in ``_coord_actor``), of whatever shape ``configure()`` returned."""
    ranks = shards if isinstance(shards, Sequence) else ()
    parts = (p for rank in ranks if isinstance(rank, Mapping) for p in rank.values())
    found: dict[Any, Any] = {}
    for part in parts:
        actor = getattr(part, "_coord_actor", None)
        if actor is not None:
            found[actor._actor_id] = actor
    return list(found.values())


def _kill(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        # Already gone, or Ray is shutting down: either way it is stopped.
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


async def make_shards(
    datasets: Mapping[str, Any],
    data_config: DataConfig,
    handles: Sequence[Any],
    node_ids: Sequence[str],
) -> list[dict[str, Any]]:
    """Each rank's dataset parts for one attempt, in rank order, for the group's nodes.

    Called for every attempt: the previous attempt's split coordinators are stopped first (their
    epoch was cut short with the workers that read it), then the datasets are split anew with
    the new workers' node ids as locality hints. The splitting runs in a thread.

    Raises:
        ConfigurationError: a :meth:`DataConfig.configure` override returned something other
            than one mapping per rank.
    """
    n = len(handles)
    actors = [getattr(h, "actor", h) for h in handles]  # Ray Train's API takes actor handles
    stale = list(getattr(datasets, "coordinators", ()))
    if stale:
        await anyio.to_thread.run_sync(_kill, stale)
        datasets.coordinators.clear()  # type: ignore[attr-defined]

    def split() -> Any:
        shards = data_config.configure(datasets, n, actors, list(node_ids))
        if isinstance(datasets, _Datasets):
            # Recorded at once, so that the next attempt or the end of the run stops them: also
            # when the parts are refused below, or the wait for this thread was cancelled.
            datasets.coordinators.extend(_coordinators(shards))
        return shards

    shards = await anyio.to_thread.run_sync(split)
    if (
        not isinstance(shards, Sequence)
        or len(shards) != n
        or not all(isinstance(s, Mapping) for s in shards)
    ):
        raise ConfigurationError(
            f"{type(data_config).__name__}.configure() must return one mapping of dataset "
            f"parts per rank ({n}), got {shards!r:.200}"
        )
    return [dict(s) for s in shards]


async def release_shards(datasets: Mapping[str, Any]) -> None:
    """Stop the split coordinators of the run's latest attempt (when the run has ended), so
    that they do not outlive it while some reference to their parts remains. The kills run in a
    thread that a caller's time bound may abandon."""
    stale = list(getattr(datasets, "coordinators", ()))
    if stale:
        datasets.coordinators.clear()  # type: ignore[attr-defined]
        await anyio.to_thread.run_sync(_kill, stale, abandon_on_cancel=True)
