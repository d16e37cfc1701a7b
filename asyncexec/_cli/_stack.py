"""``asyncexec stack``: the threads' stacks of a running cluster's asyncexec workers.

It joins the cluster as a driver of its own, finds the live worker actors in Ray's actor table
(class ``_Worker``, alive) and reads each process's stacks from outside it, with py-spy on its
node (see ``_driver.cluster._stacks``): a hung worker, which answers no call, is read like any
other.
The output is grouped by the driver (Ray job) that owns the workers, then by node and pid; the
thread that runs a run's function is named ``asyncexec-fn <executor name> rank <rank>``, and
the header of each process repeats what that name says.

Token authentication (on by default for a cluster that Ray 2.60's ``ray.init()`` starts): the
command presents a token as Ray's own CLI (``ray status``, ``ray list``) does, when
``RAY_AUTH_MODE=token``, reading it from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH``
names, or ``~/.ray/auth_token``. Without an address (or with ``auto``), Ray's own rule also turns
token mode on when it finds a token, for the local cluster it finds; an explicit address
(``--address`` or ``RAY_ADDRESS``) never gets a token unless ``RAY_AUTH_MODE=token`` says so.
A cluster that refuses the command for want of a token is told at once, with what to set
(``ray.init`` would try for about 20 s and then say only that it failed to connect).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .._driver.cluster import DUMP_TIMEOUT_S, dump_processes
from .._errors import describe, short_node

__all__ = ["WorkerProcess", "auth_refusal", "format_stacks", "live_workers", "stack_command"]

#: How long the cluster's address may take to accept a connection (``ray.init`` itself tries
#: for minutes where nothing answers).
CONNECT_TIMEOUT_S = 3.0
#: The worker actor's class, as Ray's actor table names it.
_WORKER_CLASS = "_Worker"
_FN_THREAD = re.compile(r'"asyncexec-fn (.+) rank (\d+)"')


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
        if actor.get("ActorClassName") != _WORKER_CLASS or actor.get("State") != "ALIVE":
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


def _running(text: str) -> tuple[str, int] | None:
    """The executor's name and the rank of the run's function a worker's stacks show."""
    match = _FN_THREAD.search(text)
    return None if match is None else (match.group(1), int(match.group(2)))


def _header(worker: WorkerProcess, running: tuple[str, int] | None) -> str:
    where = f"node {short_node(worker.node_id)} ({worker.node_ip})"
    head = f"=== job {worker.job_id}, {where}, pid {worker.pid}, actor {worker.actor_id[:12]}"
    if running is not None:
        head += f": executor {running[0]}, rank {running[1]}"
    return head


def format_stacks(workers: Sequence[WorkerProcess], texts: Sequence[str]) -> str:
    """The report: a summary line, then each worker's header and stacks, by driver, then by
    executor and rank where a run's function shows them (idle workers last), then node and
    pid."""
    nodes = len({w.node_id for w in workers})
    jobs = len({w.job_id for w in workers})
    lines = [f"{len(workers)} live asyncexec worker(s) on {nodes} node(s), {jobs} driver(s)"]
    found = [(w, text, _running(text)) for w, text in zip(workers, texts, strict=True)]
    found.sort(key=lambda f: (f[0].job_id, f[2] is None, f[2] or ("", 0), f[0].node_id, f[0].pid))
    for worker, text, running in found:
        lines += ["", _header(worker, running), text]
    return "\n".join(lines)


def _bootstrap(target: str) -> str | None:
    """The ``host:port`` that ``ray.init(address=target)`` joins (``"auto"`` looked up as it
    looks it up), or None when it cannot tell (a ``ray://`` address, no address on record)."""
    address: str | None = target
    if target == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            address = canonicalize_bootstrap_address(target)
        except Exception:
            return None
    if address is None or "://" in address:
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
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"nothing answers at {address} within {CONNECT_TIMEOUT_S:g} s ({describe(exc)})"


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


def stack_command(address: str | None, timeout_s: float = DUMP_TIMEOUT_S) -> int:
    """Print the stacks of every live worker of the cluster at ``address`` (None: the one
    ``RAY_ADDRESS`` or this machine's latest names); return the exit status: 0 when stacks were
    printed (a note stands for a stack that could not be taken), 1 when the cluster could not
    be joined or has no live worker."""
    import ray

    target = address or "auto"
    why = unreachable(target) or auth_refusal(target)
    if why is not None:
        print(f"asyncexec: could not join the Ray cluster at {target}: {why}", file=sys.stderr)
        return 1
    try:
        ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # ray.init's errors are not one family: say what failed
        detail = describe(exc)
        print(f"asyncexec: could not join the Ray cluster at {target}: {detail}", file=sys.stderr)
        return 1
    try:
        workers = live_workers()
        if not workers:
            print(f"asyncexec: no live asyncexec worker at {target}", file=sys.stderr)
            return 1
        targets = [(w.node_id, w.pid) for w in workers]
        dump: Any = functools.partial(dump_processes, targets, timeout_s=timeout_s)
        texts: list[str] = anyio.run(dump)
        print(format_stacks(workers, texts))
        return 0
    finally:
        ray.shutdown()
