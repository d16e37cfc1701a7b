"""The router's health watch on simulated servers (no Ray): each server is checked on its own
clock, so that a check that hangs delays no other server's."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import anyio
import pytest

import asyncexec
from asyncexec.testing import ScriptedServer, SimCluster


@dataclass
class Checks:
    """The health checks each rank has answered; rank ``hangs``'s check waits for ``release``."""

    hangs: int
    counts: Counter[int] = field(default_factory=Counter)
    changed: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)

    async def wait_count(self, rank: int, count: int) -> None:
        while self.counts[rank] < count:
            await self.changed.wait()


class Checked(ScriptedServer):
    """A :class:`ScriptedServer` whose ``health()`` is counted (and hangs on one rank)."""

    checks: ClassVar[Checks] = Checks(hangs=-1)  # (simulated servers live in the test's process)

    async def health(self) -> None:
        rank = asyncexec.get_context().world_rank
        if rank == self.checks.hangs:
            await self.checks.release.wait()
        self.checks.counts[rank] += 1
        changed, self.checks.changed = self.checks.changed, anyio.Event()
        changed.set()


@pytest.mark.timeout(30)
async def test_a_check_that_hangs_delays_no_other_servers_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: the watch checked every server in rounds, a round waiting for its slowest check:
    one server whose ``health()`` hung (a stopped engine) held every other server's next check
    until its own timed out (``health_timeout_s``, 10 s by default, each time, so that the
    others were checked every 15 s rather than every 5). Rank 1's check hangs here until rank 0
    has been checked 3 times."""
    checks = Checks(hangs=1)
    monkeypatch.setattr(Checked, "checks", checks)
    servers = asyncexec.Executor(2, roles=asyncexec.Role(Checked), cluster=SimCluster())
    async with (
        servers,
        asyncexec.Router(servers, health_interval_s=0.01, health_timeout_s=60) as router,
    ):
        with anyio.fail_after(15):  # before the fix: rank 0 waited for rank 1's 60 s
            await checks.wait_count(0, 3)
        assert checks.counts[1] == 0  # still in its first check
        checks.release.set()
        with anyio.fail_after(15):
            await checks.wait_count(1, 2)  # and checked on after its slow one
        assert all(s.serving for s in router.balance.servers)
