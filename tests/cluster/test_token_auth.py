"""``asyncexec stack`` against a real Ray cluster with token authentication on (Ray 2.60's default
for a cluster that ``ray.init()`` starts), in a process of its own: the suite's own Ray has it off
(conftest sets ``RAY_AUTH_MODE=disabled``). The cluster's token is made in a home folder of the
test's, never in the user's ``~/.ray``.

The command joins as Ray's own CLI (``ray status``, ``ray list``) does: ``RAY_AUTH_MODE=token``
with the token in ``~/.ray/auth_token``, the file ``RAY_AUTH_TOKEN_PATH`` names, or
``RAY_AUTH_TOKEN``. Without token mode it fails at once and says exactly that.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
#: Ray's variables for authentication, which the test's processes get only as each test says.
AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


@dataclass(frozen=True)
class TokenCluster:
    address: str
    home: Path  # holds .ray/auth_token, the cluster's token
    worker_pid: int

    @property
    def token_file(self) -> Path:
        return self.home / ".ray" / "auth_token"


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARIABLES}
    return {**env, **values}


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenCluster]:
    home = tmp_path_factory.mktemp("home")
    driver = subprocess.Popen(
        [sys.executable, str(HERE / "token_cluster_driver.py")],
        env=_env(HOME=str(home)),  # RAY_AUTH_MODE unset: Ray's default, token auth on
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()  # bounded by the test's timeout
        assert line.startswith("READY "), f"the driver did not start: {line!r}"
        _, address, pid = line.split()
        cluster = TokenCluster(address, home, int(pid))
        assert cluster.token_file.is_file()  # the cluster made its token there
        yield cluster
    finally:
        assert driver.stdin is not None
        driver.stdin.close()  # the driver leaves its executor and shuts its Ray down
        try:
            driver.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(10)


def _stack(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncexec", "stack", "--address", address, "--timeout", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stack_without_token_mode_fails_at_once_saying_what_to_set(
    token_cluster: TokenCluster,
) -> None:
    """Defect: the command tried for about 18 s and then said only ``ConnectionError: Failed to
    connect to Ray cluster``, though a token was at hand."""
    done = _stack(token_cluster.address, _env(HOME=str(token_cluster.home)))
    assert done.returncode == 1, done.stdout[-2000:]
    said = done.stderr
    assert f"could not join the Ray cluster at {token_cluster.address}" in said, said[-2000:]
    assert "requires token authentication" in said, said[-2000:]
    assert "set RAY_AUTH_MODE=token" in said, said[-2000:]
    assert f"a token was found in {token_cluster.token_file}" in said, said[-2000:]


@pytest.mark.parametrize("source", ["home", "token_path"])
def test_stack_joins_a_token_cluster_as_rays_cli_does(
    token_cluster: TokenCluster, tmp_path: Path, source: str
) -> None:
    """With token mode on and the token in ``~/.ray/auth_token`` (or the file that
    ``RAY_AUTH_TOKEN_PATH`` names), the command joins and prints the worker's stacks, as
    ``ray status`` joins with the same environment."""
    if source == "home":
        env = _env(HOME=str(token_cluster.home), RAY_AUTH_MODE="token")
    else:  # a home without a token
        env = _env(
            HOME=str(tmp_path),
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token_cluster.token_file),
        )
    done = _stack(token_cluster.address, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("1 live asyncexec worker(s) on 1 node(s)"), done.stdout[:500]
    assert f"pid {token_cluster.worker_pid}, actor" in done.stdout
    status = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "status", "--address", token_cluster.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr[-2000:]
