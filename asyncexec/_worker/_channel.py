"""The worker side of weight channels: how a state is read on a source rank and installed on a
target rank, and the versions a rank holds.

The user's function registers how: ``serve_weights(read)`` on the ranks of the executor that
sends (a learner), ``receive_weights(install)`` on the ranks of the executor that receives (rollout
workers). The driver's :class:`~asyncexec._driver._channel.WeightChannel` then moves a state with
the actor methods below, in threads of the worker, while the run's function keeps running.

A rank keeps the latest state it received, and every ``install`` registered later gets it,
before ``receive_weights`` returns: a state that arrived before any was registered (a worker that
joins after a restart gets the latest version before its function starts), and the state a
previous run's function installed (the next run's function registers an install of its own, and
the driver, which knows that the rank holds the version, sends nothing). An install a run's
function registered ends with the function, so a version that arrives between two runs is
kept for the next. Reports carry the version this worker holds (see ``_session``).

torch is imported only by the torch transport's methods.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import _place
from ._devices import cuda_device_index

__all__ = [
    "receive_weights",
    "serve_weights",
    "weights_version",
]

DEFAULT_CHANNEL = "weights"
_READER_POLL_S = 0.01
#: The share of a read's bound that a source rank waits for its function's ``serve_weights``.
_WAIT_SHARE = 0.8
#: How long a read waits for a running function's ``serve_weights`` before it says so in a
#: warning (a function that registers at its start does so well within it).
_NAMED_AFTER_S = 2.0
#: The standard library's logging (structlog is not imported on workers); Ray forwards a
#: worker's warnings to the driver's console.
_log = logging.getLogger("asyncexec.worker")


def _rank() -> int | str:
    context = _place.current_place().context
    return "?" if context is None else context.world_rank


class _End:
    """This process's end of one channel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read: Callable[[], Any] | None = None
        self.install: Callable[[Any, int], object] | None = None
        #: The run's session whose function registered ``install`` (None: a role's, or one
        #: registered outside a run's function): it ends with that function (see ``_live``).
        self.install_run: _place.Session | None = None
        self.version: int | None = None  # the version held (received, installed or held back)
        #: The state of ``version``, kept for an install registered later (by the next run's
        #: function, or before any was): see ``receive_weights``.
        self.state: Any = None
        self.has_state = False  # whether ``state`` holds one (which may itself be None)
        self.snapshots: dict[int, Mapping[str, Any]] = {}  # torch: read, not yet broadcast
        self.groups: dict[str, Any] = {}  # torch: process group by id
        #: torch, on a source rank: the store server of each group being built, listening from
        #: the moment its port is chosen (see ``reserve_store``) until the group is joined.
        self.stores: dict[str, Any] = {}
        #: torch: receive buffers by (group id, key), two per tensor, used in turn by version
        #: (fresh memory for each version costs more than the broadcast: page faults).
        self.buffers: dict[tuple[str, str], list[Any]] = {}


_ends: dict[str, _End] = {}
_ends_lock = threading.Lock()


def _end(name: str) -> _End:
    with _ends_lock:
        end = _ends.get(name)
        if end is None:
            end = _ends[name] = _End()
        return end


def reset() -> None:
    """Forget every channel (a pooled worker going back to its pool)."""
    with _ends_lock:
        _ends.clear()
    _place.set_report_version(None)


def serve_weights(read: Callable[[], Any], *, channel: str = DEFAULT_CHANNEL) -> None:
    """Say how this rank's state is read when the driver pushes it over ``channel``.

    Called in the function given to ``run()`` on the ranks of the sending executor. ``read`` is
    called in a thread of this worker while the function keeps running: it should return a
    consistent snapshot (copies of the tensors, taken under a lock the function holds while it
    updates them). With the object-store transport it returns any picklable state (a mapping
    when the channel is sharded: the target installs the union of the ranks' mappings); with
    the torch transport, a flat mapping of name to tensor.
    """
    if not callable(read):
        raise TypeError(f"serve_weights() takes a function, got {read!r}")
    end = _end(channel)
    with end.lock:
        end.read = read


def receive_weights(
    install: Callable[[Any, int], object], *, channel: str = DEFAULT_CHANNEL
) -> int | None:
    """Say how a state pushed over ``channel`` is installed on this rank; return the version this
    worker holds.

    Called in the function given to ``run()`` on the ranks of the receiving executor (or in a
    role's ``__init__``); it replaces the install registered before it. ``install(state,
    version)`` is called in a thread of this worker, while the function keeps running, each
    time a version arrives: guard what it changes with a lock. An install registered by a run's
    function ends with it: a version that arrives between two runs is kept for the next run's
    install (one registered in a role's ``__init__``, or in a thread of the function's own,
    stays). When this worker already holds a
    version (it joined after a restart and received the latest before its function started, or
    an earlier run's function installed it), that version is installed now, before this call
    returns: the worker keeps the latest state it received for this (with the object store,
    the state it fetched; with the torch transport, the receive buffers it keeps anyway; a role
    made again in the same process, after a spare took a rank of a group with a backend or an
    elastic resize, needs it as the next run's function does). When that ``install`` raises,
    so does this call, and ``install`` is not registered (the one registered before stays).
    """
    if not callable(install):
        raise TypeError(f"receive_weights() takes a function, got {install!r}")
    session = _place.current_session()
    end = _end(channel)
    with end.lock:
        before = end.install, end.install_run
        end.install = install
        end.install_run = session if session is not None and _in_function(session) else None
        version = end.version
        if end.has_state and version is not None:
            try:
                install(_fresh(end.state), version)
            except BaseException:  # (a role whose ``__init__`` fails so: no version reaches it)
                end.install, end.install_run = before
                raise
    return version


def forget_install(install: Callable[[Any, int], object], *, channel: str) -> None:
    """Unregister ``install`` from ``channel`` when it is the install registered there (a
    rollout server that its worker let go of): no version reaches it from now on; an install
    of it that runs now ends first. The versions that arrive meanwhile are kept for the next
    install registered, as when none was. Blocking (it waits for that install): runs in a
    thread."""
    with _ends_lock:
        end = _ends.get(channel)
    if end is None:
        return
    with end.lock:
        if end.install == install:  # (bound methods: equal when of the same instance)
            end.install, end.install_run = None, None


def _in_function(session: _place.Session) -> bool:
    """Whether this thread is the one running ``session``'s function (an ``async def`` too:
    its loop runs there), not an ``execute()`` call or a thread of the function's own."""
    return session.thread is threading.current_thread()


def _live(end: _End) -> Callable[[Any, int], object] | None:
    """``end``'s install, unless its run's function has ended: what it installs into went with
    the function (the next run registers its own, and gets the kept state then)."""
    if end.install_run is not None and end.install_run is not _place.current_session():
        end.install, end.install_run = None, None
    return end.install


def _fresh(state: Any) -> Any:
    """A mapping of the state's own (the same values), so that an install that takes keys out
    of what it was given (``state.pop("step")``) leaves the kept state whole."""
    return dict(state) if type(state) is dict else state


def close(name: str) -> None:
    """Forget channel ``name`` in this process (its process groups, buffers and snapshots; the
    latest state stays, for the installs registered later: see ``receive_weights``)."""
    with _ends_lock:
        end = _ends.get(name)
    if end is not None:
        with end.lock:
            end.groups.clear()
            end.buffers.clear()
            end.snapshots.clear()
            end.stores.clear()


def weights_version(channel: str = DEFAULT_CHANNEL) -> int | None:
    """The version of ``channel`` this worker holds (None before the first arrives)."""
    end = _ends.get(channel)
    return None if end is None else end.version


# The driver's calls (through the actor) ---------------------------------------------------------


class NoReaderError(LookupError):
    """This source rank has no ``serve_weights`` for the channel (see :func:`read_state`)."""


def read_state(name: str, timeout_s: float, *, mapping: bool = True) -> Any:
    """This rank's state, read with the function ``serve_weights`` registered; a mapping,
    unless ``mapping`` is False (the object-store transport of an unsharded channel takes any
    picklable state). Blocking: runs in a thread.

    With none registered: while a run's function runs here (it may register one yet), waits
    for it up to ``_WAIT_SHARE`` of ``timeout_s`` (the driver's bound on the whole read: this
    error, naming what is missing, comes back before it), and says so in a warning once it has
    waited ``_NAMED_AFTER_S`` (a function that forgot the call is named then, not at the
    bound; one still loading its model may call it yet); with no function running, nothing
    can register one, and the rank says so at once.

    Raises:
        NoReaderError: naming ``serve_weights`` and the channel.
    """
    end = _end(name)
    started = time.monotonic()
    wait_s = timeout_s * _WAIT_SHARE
    named = False
    while end.read is None:
        session = _place.current_session()
        running = session is not None and not session.finished
        waited_s = time.monotonic() - started
        if not running or waited_s > wait_s:
            why = (
                f"its run's function registered none within {wait_s:.3g} s"
                if running
                else "no run's function is running here to register one"
            )
            raise NoReaderError(
                f"rank {_rank()} of the source has no serve_weights(read, channel={name!r}) "
                f"({why}): call asyncexec.serve_weights(read) in the source's run function "
                "or in its role's __init__"
            )
        if not named and waited_s >= min(_NAMED_AFTER_S, wait_s / 2):
            named = True
            _log.warning(
                "serve_weights_missing rank=%s channel=%r waited_s=%.3g waits_up_to_s=%.3g: "
                "a push waits for this rank's run function to call "
                "asyncexec.serve_weights(read, channel=%r), which it has not called",
                _rank(),
                name,
                waited_s,
                wait_s,
                name,
            )
        time.sleep(_READER_POLL_S)
    state = end.read()
    if mapping and not isinstance(state, Mapping):
        kind = type(state).__name__
        raise TypeError(
            f"the serve_weights function returned {kind}, not a mapping (a sharded channel, and "
            "the torch transport, move mappings)"
        )
    return state


def install_state(name: str, version: int, state: Any) -> None:
    """Install ``version`` (with no install registered, hold it until ``receive_weights``) and
    keep its state for the installs registered later; a late, older version never replaces a
    newer one. Reports made from then on hold it. Blocking: runs in a thread."""
    end = _end(name)
    with end.lock:
        if end.version is not None and version <= end.version:
            return
        kept = _fresh(state)
        install = _live(end)
        if install is not None:
            install(state, version)
        end.state, end.has_state = kept, True
        end.version = version
        _place.set_report_version(version)


def merge(shards: list[Any]) -> Any:
    """One state from the shards of a sharded push (by key; the shards must not overlap); the
    one shard of an unsharded push as it is."""
    if len(shards) == 1:
        return shards[0]
    merged: dict[str, Any] = {}
    for shard in shards:
        overlap = merged.keys() & shard.keys()
        if overlap:
            raise ValueError(f"the shards of a sharded push overlap on {sorted(overlap)[:5]}")
        merged.update(shard)
    return merged


# The torch transport ----------------------------------------------------------------------------


def reserve_store(name: str, group_id: str, timeout_s: float) -> tuple[str, int]:
    """On a source rank: start the store server of process group ``group_id`` on a port the
    kernel picks and keep it listening until the group is joined; return this node's address
    and the port. (Choosing a free port, closing it and binding it later, at the join, left it
    to anyone on the node in between: the race the torch backend also avoids.) A set-up that
    fails at another rank's port call closes the servers it reserved (``release_stores``); those
    of an earlier set-up still here (a port call the driver gave up on, which ended after it;
    a release that did not reach this rank) are closed here: each would listen, with its
    thread, until the channel closed."""
    import datetime

    import ray
    import torch.distributed as dist

    address = ray.util.get_node_ip_address()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        address,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    end = _end(name)
    with end.lock:
        # Only the earlier set-ups': a port call of one that the driver gave up on may end
        # after the next set-up's, whose server must stay.
        for old in [k for k in end.stores if _earlier(k, group_id)]:
            del end.stores[old]  # the server closes when dropped
        end.stores[group_id] = store
    return address, int(store.port)


def release_stores(name: str, group_ids: list[str]) -> None:
    """On a source rank: close the store servers reserved for ``group_ids`` (see
    ``reserve_store``), of a set-up that failed before they were joined."""
    with _ends_lock:
        end = _ends.get(name)
    if end is None:
        return
    with end.lock:
        for group_id in group_ids:
            end.stores.pop(group_id, None)  # the server closes when dropped


def _earlier(old: str, new: str) -> bool:
    """Whether process group ``old`` is of an earlier set-up of the same channel than ``new``
    (ids are ``<channel id>.<set-up number>/<source rank>``)."""
    old_channel, _, old_number = old.split("/")[0].rpartition(".")
    new_channel, _, new_number = new.split("/")[0].rpartition(".")
    try:
        return old_channel == new_channel and int(old_number) < int(new_number)
    except ValueError:
        return False


def join_group(
    name: str,
    group_id: str,
    address: str,
    port: int,
    rank: int,
    size: int,
    backend: str,
    timeout_s: float,
) -> None:
    """Join one of the channel's process groups (rank 0 is its source). Blocking: every member
    calls it at once."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    end = _end(name)
    if rank == 0:  # the source: its store server is already listening (see reserve_store)
        with end.lock:
            store = end.stores.pop(group_id)
    else:
        store = dist.TCPStore(address, port, size, False, timeout=timeout)  # type: ignore[attr-defined]
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    with end.lock:
        generation = group_id.split("/")[0]
        for old in list(end.groups):
            if old.split("/")[0] != generation:
                del end.groups[old]  # a previous generation
        for key in [k for k in end.buffers if k[0].split("/")[0] != generation]:
            del end.buffers[key]
        end.groups[group_id] = group


def snapshot(name: str, version: int, timeout_s: float) -> list[tuple[str, tuple[int, ...], str]]:
    """Read this source rank's state for ``version`` and keep it until it is broadcast; return
    what the receivers allocate: (name, shape, dtype) per tensor."""
    import torch

    state = read_state(name, timeout_s)
    tensors: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"the torch transport moves tensors; {key!r} is a {type(value).__name__}"
            )
        tensors[key] = value.detach().contiguous()
    end = _end(name)
    with end.lock:
        end.snapshots[version] = tensors
    return [(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()]


def send(name: str, version: int, group_id: str) -> int:
    """Broadcast the snapshot of ``version`` from this source rank; return the bytes sent."""
    import torch.distributed as dist

    end = _end(name)
    with end.lock:
        tensors = end.snapshots.pop(version)
        for older in [v for v in end.snapshots if v < version]:
            del end.snapshots[older]  # read for a push that failed
        group = end.groups[group_id]
    sent = 0
    for tensor in tensors.values():
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor], options).wait()
        sent += tensor.numel() * tensor.element_size()
    return sent


def receive(
    name: str,
    version: int,
    parts: list[tuple[str, list[tuple[str, tuple[int, ...], str]]]],
    device: str,
    reuse: bool = True,
) -> int:
    """Receive ``version`` from each source's group (one part per source), then install it;
    return the bytes received. With ``reuse``, the tensors are received into two buffers per
    tensor used in turn, so the ones given to ``install`` are written again two versions
    later."""
    import torch
    import torch.distributed as dist

    end = _end(name)
    device = _own(device)
    shards: list[Mapping[str, Any]] = []
    received = 0
    for group_id, meta in parts:
        with end.lock:
            group = end.groups[group_id]
        shard: dict[str, Any] = {}
        for key, shape, dtype in meta:
            tensor = _buffer(end, (group_id, key), shape, getattr(torch, dtype), device, version)
            if tensor is None or not reuse:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                if reuse:
                    end.buffers.setdefault((group_id, key), [None, None])[version % 2] = tensor
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()
            shard[key] = tensor
            received += tensor.numel() * tensor.element_size()
        shards.append(shard)
    install_state(name, version, merge(shards))
    return received


def _own(device: str) -> str:
    """``device`` (``"cpu"`` or ``"cuda"``) as this worker's own: its GPU for ``"cuda"``. The
    current CUDA device is per thread, and the thread that receives never set one: ``"cuda"``
    would be GPU 0 for every rank of a node that sees the node's GPUs."""
    if device != "cuda":
        return device
    context = _place.current_place().context
    gpu_ids = () if context is None else context.accelerator_ids.get("GPU", ())
    local_rank = 0 if context is None else context.local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"cuda:{cuda_device_index(gpu_ids, visible, local_rank)}"


def _buffer(
    end: _End, key: tuple[str, str], shape: tuple[int, ...], dtype: Any, device: str, version: int
) -> Any:
    """The buffer of ``key`` for ``version``'s turn, when one of that shape and type exists."""
    pair = end.buffers.get(key)
    tensor = pair[version % 2] if pair is not None else None
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        return None
    if str(tensor.device) != device:
        return None
    return tensor


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
