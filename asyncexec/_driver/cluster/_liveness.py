"""Whether nodes are alive, as a cluster's node table says, asked once for many askers.

One death fails every call in flight on the dead worker at once, and each failure asks whether
the worker's node is still there (a lost node or a crashed worker). :class:`Liveness` asks the
node table about a node one look-up at a time (per thread: each event loop shares its own):
askers that come while a look-up is on its way share its answer; an answer is kept a moment
(:data:`ALIVE_TTL_S`; a node's death is final, so "dead" is kept until the bound of the cache
pushes it out); and each look-up has a bound of its own (the look-up itself is given the
timeout, and its thread is abandoned at it). A look-up that fails or does not answer in time
says "alive" (unknown), and is not kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import anyio

from ..._errors import describe, short_node
from ..._logging import get_logger

__all__ = ["ALIVE_TTL_S", "Liveness"]

#: How long an answer that a node is alive is kept.
ALIVE_TTL_S = 1.0
#: The most answers kept (the oldest go first).
_BOUND = 1024
_log = get_logger(component="cluster")


class _Asking:
    """A look-up on its way, and its answer once it has one."""

    __slots__ = ("alive", "done")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.alive = True


class Liveness:
    """A node-liveness cache in front of a blocking look-up (see the module's docstring).

    Args:
        lookup: ``lookup(node_id, timeout_s)``, blocking (run in a thread): whether the node
            table holds the node as alive.
        timeout_s: the bound of one look-up.
        ttl_s: how long an "alive" answer is kept.
    """

    def __init__(
        self,
        lookup: Callable[[str, float], bool],
        timeout_s: float,
        ttl_s: float = ALIVE_TTL_S,
        bound: int = _BOUND,
    ) -> None:
        self._lookup = lookup
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.bound = bound
        self._known: dict[str, tuple[float, bool]] = {}  # node -> (answered at, alive)
        #: Look-ups on their way, by the asking thread (each has its own event loop: an
        #: executor may run in a thread of its own) and node.
        self._asking: dict[tuple[int, str], _Asking] = {}
        #: Look-ups made so far (the node table asked), for tests and statistics.
        self.lookups = 0

    def __repr__(self) -> str:
        return f"<Liveness known={len(self._known)} asking={len(self._asking)}>"

    async def alive(self, node_id: str | None) -> bool:
        """Whether ``node_id`` is alive (True for None, and when the table cannot tell in
        time). At most one look-up per node at a time; never longer than its bound."""
        if node_id is None:
            return True
        known = self._known.get(node_id)
        if known is not None and (not known[1] or time.monotonic() - known[0] < self.ttl_s):
            return known[1]
        key = (threading.get_ident(), node_id)
        asking = self._asking.get(key)
        if asking is not None:
            await asking.done.wait()
            return asking.alive
        asking = self._asking[key] = _Asking()
        try:
            # Shielded so that the askers who share it get an answer even when the one who
            # started it goes; bounded by the look-up's own timeout (``_ask``, its thread
            # abandoned at it).
            with anyio.CancelScope(shield=True):
                asking.alive = await self._ask(node_id)
        finally:
            del self._asking[key]
            asking.done.set()
        return asking.alive

    async def _ask(self, node_id: str) -> bool:
        self.lookups += 1
        with anyio.move_on_after(self.timeout_s):
            try:
                alive = await anyio.to_thread.run_sync(
                    self._lookup, node_id, self.timeout_s, abandon_on_cancel=True
                )
            except Exception as exc:  # unknown: the caller's error is mapped without it
                _log.warning("node_lookup_failed", node=short_node(node_id), error=describe(exc))
                return True
            self._keep(node_id, alive)
            return alive
        _log.warning("node_lookup_timed_out", node=short_node(node_id), timeout_s=self.timeout_s)
        return True

    def _keep(self, node_id: str, alive: bool) -> None:
        self._known.pop(node_id, None)
        self._known[node_id] = (time.monotonic(), alive)
        while len(self._known) > self.bound:
            del self._known[next(iter(self._known))]
