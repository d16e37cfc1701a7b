"""examples/rollout_servers.py in a short configuration: requests sent at once to the least-loaded
of three servers under a cap in flight, answers taken as they come back, a server killed midway
(on Ray) and its requests sent again to the others; in local mode the servers are threads of
the test's process and the kill is skipped."""

from __future__ import annotations

import pytest
from conftest import import_example


@pytest.mark.timeout(60)
async def test_every_request_is_answered_once_under_the_cap_through_a_killed_server(
    mode: str,
) -> None:
    servers = import_example("rollout_servers")
    requests = servers.make_requests(60)
    summary = await servers.main(
        servers=3, requests=60, max_in_flight=2, kill_after=15, token_s=0.002
    )
    # Every request answered exactly once, and rightly (the same answer on any server).
    assert summary.answered_once
    assert sorted(a.id for a in summary.answers) == list(range(60))
    assert all(a.tokens == servers.complete(requests[a.id]) for a in summary.answers)
    # Handled as they came back, not in submission order (requests ask for 8 to 32 tokens).
    assert [a.id for a in summary.answers] != list(range(60))
    # No server ever held more than the cap, by the servers' own counts.
    assert max(a.held for a in summary.answers) <= 2
    assert summary.most_in_flight <= 2
    if mode == "ray":
        # Server 1 was killed after the 15th answer, with calls in flight on it: those were
        # sent again and answered by the other servers.
        assert summary.killed_pid is not None
        assert not summary.kill_skipped
        killed = [i for i, a in enumerate(summary.answers) if a.pid == summary.killed_pid]
        assert killed and max(killed) < 15  # it answered nothing after it died
        assert summary.sent_again >= 1
    else:
        # Local mode: the servers are threads of this process; there is nothing to kill.
        assert summary.kill_skipped
        assert summary.killed_pid is None
        assert summary.sent_again == 0
