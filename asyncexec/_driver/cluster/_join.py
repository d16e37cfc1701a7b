"""Joining a running cluster from outside it, for ``asyncexec stack``: whether its address
answers and whether it wants a token (told at once, where ``ray.init`` would try for a long
while and then say only that it failed to connect), joining it, and its live asyncexec workers
as Ray's actor table knows them.

Token authentication (on by default for a cluster that Ray 2.60's ``ray.init()`` starts): the
command presents a token as Ray's own CLI (``ray status``, ``ray list``) does, when
``RAY_AUTH_MODE=token``, reading it from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH``
names, or ``~/.ray/auth_token``. Without an address (or with ``auto``), Ray's own rule also turns
token mode on when it finds a token, for the local cluster it finds; an explicit address
(``--address`` or ``RAY_ADDRESS``) never gets a token unless ``RAY_AUTH_MODE=token`` says so.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from ..._errors import describe
from ..._worker import ThreadedWorkerCode, WorkerCode

__all__ = [
    "WorkerProcess",
    "auth_refusal",
    "dead_cluster",
    "dead_cluster_on_record",
    "join_cluster",
    "live_workers",
    "unreachable",
]

#: How long the cluster's address may take to accept a connection (``ray.init`` itself tries
#: for minutes where nothing answers).
CONNECT_TIMEOUT_S = 3.0
#: The worker actors' classes, as Ray's actor table names them: a group whose roles have
#: ``async def`` methods runs the async actor, one whose roles have only plain ones the threaded.
_WORKER_CLASSES = frozenset({WorkerCode.__name__, ThreadedWorkerCode.__name__})


@dataclass(frozen=True)
class WorkerProcess:
    """One live worker actor as Ray's actor table knows it."""

    job_id: str
    node_id: str
    node_ip: str
    pid: int
    actor_id: str


def live_workers() -> list[WorkerProcess]:
    """The cluster's live asyncexec workers, by job, node and pid. Blocking.

    Read from the GCS actor table (``ray._private.state``), which needs no dashboard: Ray's
    public state API (``ray.util.state.list_actors``) is served by the dashboard, which a
    cluster started with ``include_dashboard=False`` does not run."""
    import ray._private.state as ray_state

    found = []
    for actor in ray_state.actors().values():
        if actor.get("ActorClassName") not in _WORKER_CLASSES or actor.get("State") != "ALIVE":
            continue
        address = actor.get("Address") or {}
        found.append(
            WorkerProcess(
                job_id=str(actor.get("JobID", "")),
                node_id=str(address.get("NodeID", "")),
                node_ip=str(address.get("IPAddress", "")),
                pid=int(actor.get("Pid", 0)),
                actor_id=str(actor.get("ActorID", "")),
            )
        )
    return sorted(found, key=lambda w: (w.job_id, w.node_id, w.pid))


def _bootstrap(target: str) -> str | None:
    """The ``host:port`` that ``ray.init(address=target)`` joins (``"auto"`` looked up as it
    looks it up, a local host name as the node's address, as Ray connects to it), or None when
    it cannot tell (a ``ray://`` address, ``"local"``, no address on record)."""
    if "://" in target:
        return None
    from ray._private.services import canonicalize_bootstrap_address

    try:
        address: str | None = canonicalize_bootstrap_address(target)
    except Exception:
        return None
    return address


def unreachable(target: str) -> str | None:
    """Why nothing answers at the cluster's address ``target`` (``"auto"`` is looked up as
    ``ray.init`` looks it up), or None when something does or it cannot tell (a ``ray://``
    address, no address on record)."""
    address = _bootstrap(target)
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        where = address
        if target not in ("auto", address):  # a local host name: Ray joins the node's address
            where = f"{target} ({address}, where Ray connects)"
        return f"nothing answers at {where} within {CONNECT_TIMEOUT_S:g} s ({describe(exc)})"


def dead_cluster_on_record(address: str | None) -> str | None:
    """Why ``ray.init(address=address)`` would wait minutes on a cluster that is gone, or None.

    Without an address (or with ``"auto"``) and without ``RAY_ADDRESS``, Ray joins the cluster
    its address file (``<temp>/ray_current_cluster``) names; ``ray start`` and Ray's test
    clusters write it, and a cluster killed before ``ray stop`` leaves it behind. ``ray.init``
    then waits about a minute on the dead GCS and says only that it could not connect. One TCP
    connect (a local address: milliseconds) tells it at once."""
    if address not in (None, "auto") or os.environ.get("RAY_ADDRESS"):
        return None
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            recorded = f.read().strip()
    except OSError:
        return None  # no file: Ray starts a local cluster
    why = unreachable(recorded) if recorded else None
    if why is None:
        return None
    return (
        f"Ray would join the cluster that {path} names, but {why}: that cluster was stopped "
        "without `ray stop`. Run `ray stop` (it removes the file) or delete the file to start "
        "a fresh local Ray, or pass address='local'"
    )


def dead_cluster(address: str | None) -> str | None:
    """Why ``ray.init(address=address)`` would wait minutes on a cluster that does not answer,
    or None: the ``address`` given (not ``"auto"``), else the one ``RAY_ADDRESS`` names, else
    the one on record (see :func:`dead_cluster_on_record`). Ray itself retries an address
    where nothing answers for minutes and then says only that it could not connect; one TCP
    connect tells it at once (a ``ray://`` address is left to Ray)."""
    named = os.environ.get("RAY_ADDRESS")
    if address not in (None, "auto"):
        source = f"the address {address!r}"
        why = unreachable(address)
    elif named:
        source = f"RAY_ADDRESS ({named!r})"
        why = unreachable(named)
    else:
        return dead_cluster_on_record(address)
    if why is None:
        return None
    return (
        f"Ray would join the cluster at {source}, but {why}: check the address and that the "
        "cluster runs (`ray status` on its head node), or pass address='local' for a fresh "
        "local Ray"
    )


def _token_source() -> str | None:
    """Where Ray finds a token in this process (as ``ray status`` would read it), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return path if os.path.isfile(path) else None
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None


def auth_refusal(target: str) -> str | None:
    """Why the cluster at ``target`` refuses this process for want of a token, with what to
    set, or None when it does not (or it cannot tell: then ``ray.init`` says what fails).

    ``ray.init`` presents a token when ``RAY_AUTH_MODE=token``; without it, Ray's own rule
    turns token mode on for ``"auto"`` (no ``RAY_ADDRESS``, mode unset) when a token is
    found. Otherwise one unauthenticated GCS call (milliseconds) tells whether the cluster
    wants a token."""
    from ray._raylet import AuthenticationMode, GcsClient, get_authentication_mode
    from ray.exceptions import AuthenticationError

    if get_authentication_mode() == AuthenticationMode.TOKEN:
        return None  # ray.init presents the token, or says that none was found
    source = _token_source()
    found_by_ray = target == "auto" and not os.environ.get("RAY_ADDRESS")
    if found_by_ray and "RAY_AUTH_MODE" not in os.environ and source is not None:
        return None  # Ray's rule: a local cluster found automatically gets the token
    address = _bootstrap(target)
    if address is None:
        return None
    try:
        GcsClient(address=address)
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        found = f"; a token was found in {source}" if source is not None else ""
        return (
            f"the cluster requires token authentication, and RAY_AUTH_MODE is {mode} here: "
            "set RAY_AUTH_MODE=token (as Ray's own CLI needs it), with the cluster's token in "
            "~/.ray/auth_token, in the file RAY_AUTH_TOKEN_PATH names, or in RAY_AUTH_TOKEN "
            f"(`ray get-auth-token` prints it on a node of the cluster){found}"
        )
    except Exception:
        return None
    return None


def join_cluster(target: str) -> str | None:
    """Join the cluster at ``target`` (``"auto"``: the one ``RAY_ADDRESS`` or this machine's
    latest names) as a driver of its own, quietly; return why it could not be joined, or None
    when it was. Blocking; leave with :func:`~asyncexec._driver.cluster.shutdown_ray`."""
    import ray

    why = unreachable(target) or auth_refusal(target)
    if why is not None:
        return why
    try:
        ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # ray.init's errors are not one family: say what failed
        return describe(exc)
    return None
