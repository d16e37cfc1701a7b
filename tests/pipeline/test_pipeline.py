"""The pipeline against rollout servers that are worker classes (a toy engine: an async generator
that sleeps per chunk), on Ray actors and in local mode: each weight-update mode, the strict
bound under a random workload, the aggregate mode's measured staleness, S = 0 as the
synchronous loop, aborted prompts requeued at the head, multi-version samples over a weight
channel, exactly-once consumption through a driver killed and resumed."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

import asyncexec
from asyncexec.testing import metrics_enabled

CPU = {"CPU": 0.25}


class Toy(asyncexec.RolloutServer):
    """``prompt["length"]`` chunks of ``chunk_s`` each (``prompt["slow"]``: 50 of 5 ms); each
    chunk is the weights it ran on. Records (id, version) when a generation starts."""

    def __init__(self, chunk_s: float = 0.002) -> None:
        super().__init__()
        self.chunk_s = chunk_s
        self.weights: Any = None
        self.started: list[tuple[int, int | None]] = []

    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[Any]:
        self.started.append((prompt["id"], self.weights_version()))
        slow = prompt.get("slow", False)
        for _ in range(50 if slow else prompt["length"]):
            await asyncio.sleep(0.005 if slow else self.chunk_s)
            yield self.weights

    def load_weights(self, state: Any, version: int) -> None:
        self.weights = state

    def records(self) -> list[tuple[int, int | None]]:
        return list(self.started)


def _servers(n: int = 2) -> asyncexec.Executor:
    return asyncexec.Executor(n, resources_per_worker=CPU, roles=asyncexec.Role(Toy))


def _check_chunks(batches: list[asyncexec.PipelineBatch]) -> None:
    """Each chunk ran on the weights of the version it is tagged with."""
    for batch in batches:
        for sample in batch.samples:
            assert len(sample.output) == len(sample.versions)
            for weights, version in zip(sample.output, sample.versions, strict=True):
                assert weights == (None if version is None else {"w": version})


@pytest.mark.timeout(60)
async def test_each_update_mode_hands_every_prompt_once_within_the_bound(mode: str) -> None:
    prompts = [{"id": i, "length": 3 + (i * 7) % 12} for i in range(30)]
    modes = itertools.cycle(["keep", "wait", "abort"])
    batches: list[asyncexec.PipelineBatch] = []
    async with (
        _servers() as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=1) as pipe,
    ):
        async for batch in pipe:
            batches.append(batch)
            await pipe.update_weights({"w": pipe.version + 1}, on_update=next(modes))
    ids = [i for b in batches for i in b.ids]
    assert sorted(ids) == list(range(30))  # each once; the last batch holds the 2 left
    assert [len(b) for b in batches] == [4] * 7 + [2]
    assert [b.version for b in batches] == list(range(8))
    stats = pipe.statistics()
    assert stats.beyond_bound == 0 and stats.staleness_max <= 1
    assert max(b.staleness_max for b in batches) == stats.staleness_max
    assert set(stats.pauses) == {"keep", "wait", "abort"}
    assert sum(p.updates for p in stats.pauses.values()) == stats.version == 8
    assert stats.requeued == stats.aborted and stats.consumed == 30
    assert stats.admitted == 30 + stats.requeued
    _check_chunks(batches)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bound", ["strict", "aggregate"])
async def test_random_workload_strict_has_no_sample_beyond_s_aggregate_measures(
    mode: str, bound: Literal["strict", "aggregate"]
) -> None:
    """Long-tailed lengths (1 to 60 chunks), random time between a batch and its update."""
    rng = random.Random(7)
    lengths = [min(60, int(rng.paretovariate(1.1))) for _ in range(48)]
    prompts = [{"id": i, "length": n} for i, n in enumerate(lengths)]
    batches = []
    async with (
        _servers() as servers,
        asyncexec.Pipeline(
            servers, prompts, batch_size=4, staleness=2, mode=bound, on_update="keep"
        ) as pipe,
    ):
        async for batch in pipe:
            batches.append(batch)
            await anyio.sleep(rng.uniform(0, 0.02))
            await pipe.update_weights({"w": pipe.version + 1})
    every = [s for b in batches for s in b.staleness]
    stats = pipe.statistics()
    assert sorted(i for b in batches for i in b.ids) == list(range(48))
    assert stats.staleness_max == max(every)
    assert stats.beyond_bound == sum(s > 2 for s in every)
    assert stats.staleness_mean == pytest.approx(sum(every) / len(every), abs=1e-3)
    if bound == "strict":
        assert stats.beyond_bound == 0
    _check_chunks(batches)


@pytest.mark.timeout(60)
async def test_staleness_zero_is_the_synchronous_loop(mode: str) -> None:
    """Batch k's samples are all made by version k, and nothing is generated while the
    learner holds a batch."""
    prompts = [{"id": i, "length": 2 + i % 5} for i in range(16)]
    async with (
        _servers() as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=0, on_update="wait") as pipe,
    ):
        async for batch in pipe:
            assert pipe.statistics().in_flight == 0
            for sample in batch.samples:
                assert set(sample.versions) == {batch.version or None}
            await pipe.update_weights({"w": pipe.version + 1})
    assert pipe.statistics().version == 4 and pipe.statistics().staleness_max == 0


@pytest.mark.timeout(60)
async def test_abort_requeues_the_prompts_in_flight_at_the_head(mode: str) -> None:
    """Prompts 0 and 1 are slow: the first batch is 2 and 3, the abort update ends 0 and 1,
    and they are the first prompts the server starts at the new version (and are aborted
    again by the next updates, until the source runs out: abort restarts a generation)."""
    prompts = [{"id": i, "length": 1, "slow": i < 2} for i in range(8)]
    async with (
        _servers(1) as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=1, on_update="abort") as pipe,
    ):
        batches = []
        async for batch in pipe:
            batches.append(batch)
            await pipe.update_weights({"w": pipe.version + 1})
        [records] = await servers.call(asyncexec.method(Toy, Toy.records))
    assert sorted(batches[0].ids) == [2, 3]
    stats = pipe.statistics()
    assert stats.aborted >= 2 and stats.requeued == stats.aborted
    at_one = [i for i, version in records if version == 1]
    # Admitted first at version 1 (with 4 and 5, in the same wave: on Ray concurrent calls
    # may reach the server in another order; in local mode they reach it in order).
    assert {0, 1} <= set(at_one[:4])
    if mode == "local":
        assert at_one[:2] == [0, 1]
    assert sorted(i for b in batches for i in b.ids) == list(range(8))


@pytest.mark.timeout(30)
async def test_a_second_batch_before_the_update_at_s0_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    prompts = [{"id": i, "length": 1} for i in range(8)]
    async with (
        _servers() as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=0) as pipe,
    ):
        with pytest.raises(asyncexec.ExecutorStateError, match="before a batch"):
            await pipe.update_weights({"w": 1})  # strict: no batch at version 0 yet
        await pipe.__anext__()
        with pytest.raises(asyncexec.ExecutorStateError, match="update_weights"):
            await pipe.__anext__()


def test_bad_arguments_are_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    servers = _servers()
    bad: list[dict[str, Any]] = [
        {"batch_size": 0},
        {"staleness": -1},
        {"mode": "loose"},
        {"on_update": "later"},
        {"channel": object()},
        {"consumed": {"watermark": 1}},
    ]
    for kwargs in bad:
        with pytest.raises(asyncexec.ConfigurationError):
            asyncexec.Pipeline(servers, [], **kwargs)
    with pytest.raises(asyncexec.ConfigurationError):
        asyncexec.Pipeline(object(), [])


def test_every_argument_of_the_rl_loop_is_checked_when_it_is_made() -> None:
    """Each of Router's, Pipeline's and WeightChannel's arguments is refused when the object is
    made, naming it (nothing is started: the executors are not entered)."""
    learner, servers = asyncexec.Executor(1, local=False), _servers()
    other = asyncexec.Executor(1, local=False)
    elsewhere = asyncexec.WeightChannel(learner, other)
    channel = asyncexec.WeightChannel(learner, servers)
    bad_channels: list[tuple[dict[str, Any], str]] = [
        ({"sharded": "yes"}, "sharded must be a bool"),
        ({"reuse_buffers": 1}, "reuse_buffers must be a bool"),
        ({"timeout_s": float("nan")}, "timeout_s must be"),
        ({"timeout_s": float("inf")}, "timeout_s must be"),
        ({"timeout_s": True}, "timeout_s must be"),
        ({"torch_backend": "nccl"}, r'torch_backend=.nccl. applies to transport="torch" only'),
        ({"reuse_buffers": False}, r'reuse_buffers=False applies to transport="torch" only'),
    ]
    for kwargs, needle in bad_channels:
        with pytest.raises(asyncexec.ConfigurationError, match=needle):
            asyncexec.WeightChannel(learner, servers, **kwargs)
    with pytest.raises(asyncexec.ConfigurationError, match="into the router's servers"):
        asyncexec.Router(servers, channel=elsewhere)
    with pytest.raises(asyncexec.ConfigurationError, match="into the pipeline's servers"):
        asyncexec.Pipeline(servers, [], channel=elsewhere)
    with pytest.raises(asyncexec.ConfigurationError, match="the router's channel"):
        other_channel = asyncexec.WeightChannel(other, servers)
        asyncexec.Pipeline(asyncexec.Router(servers, channel=channel), [], channel=other_channel)
    with pytest.raises(asyncexec.ConfigurationError, match=r"prompts must be .*not a str"):
        asyncexec.Pipeline(servers, "prompts")
    with pytest.raises(asyncexec.ConfigurationError, match=r"not a mapping .*prompts\.items"):
        asyncexec.Pipeline(servers, {7: "a prompt"})
    resumed = {"format": 1, "version": 0, "watermark": 2.5, "above": []}
    with pytest.raises(asyncexec.ConfigurationError, match=r"consumed=.*watermark must be an int"):
        asyncexec.Pipeline(servers, [], consumed=resumed)
    asyncexec.WeightChannel(learner, servers, transport="torch", torch_backend="gloo")
    with pytest.raises(asyncexec.ConfigurationError, match="max_requeues"):
        asyncexec.Pipeline(servers, [], max_requeues=True)
    asyncexec.Pipeline(asyncexec.Router(servers, channel=channel), [], channel=channel)


class NotAServer:
    def work(self) -> int:
        return 1


def test_an_executor_of_no_rollout_server_is_refused_in_the_pipelines_words() -> None:
    """It was refused in the words of the Router the pipeline makes ("a Router needs an
    executor..."), which the user did not make."""
    servers = asyncexec.Executor(1, local=True, roles=asyncexec.Role(NotAServer))
    with pytest.raises(asyncexec.ConfigurationError, match=r"^a Pipeline's servers .* has 0$"):
        asyncexec.Pipeline(servers, range(4), batch_size=2)


# Over a weight channel ------------------------------------------------------------------------


class Learner:
    def __init__(self) -> None:
        self.w = 0
        asyncexec.serve_weights(lambda: {"w": self.w})

    def step(self) -> int:
        self.w += 1
        return self.w


@pytest.mark.ray_only
@pytest.mark.timeout(90)
async def test_keep_over_a_weight_channel_gives_samples_a_version_per_chunk(mode: str) -> None:
    """The servers install through ``load_weights`` from the channel (registered in
    ``RolloutServer.__init__``, outside any run); the slow prompt 0 is parked by the update
    and goes on with the new weights (``on_expire="wait"``: the batch of version 1 waits for
    it, where the default would requeue it)."""
    prompts = [{"id": i, "length": 1, "slow": i == 0} for i in range(6)]
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Learner)) as learner,
        _servers() as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
        asyncexec.Pipeline(
            servers, prompts, batch_size=2, staleness=1, channel=channel, on_expire="wait"
        ) as pipe,
    ):
        batches = []
        async for batch in pipe:
            batches.append(batch)
            await learner.call(Learner.step)
            assert await pipe.update_weights() == pipe.version
        versions = await servers.call(asyncexec.method(Toy, Toy.weights_version))
    assert versions == [4, 4]  # the channel's: the pipeline's first push and 3 updates
    [slow] = [s for b in batches for s in b.samples if s.id == 0]
    assert slow.versions[0] == 0 and slow.versions[-1] == 1  # parked, went on at version 1
    assert slow.version == 0
    assert pipe.statistics().beyond_bound == 0
    _check_chunks(batches)


@pytest.mark.ray_only
@pytest.mark.timeout(90)
@pytest.mark.parametrize("first_push", [False, True])
async def test_samples_and_batches_count_versions_on_one_scale(mode: str, first_push: bool) -> None:
    """A sample's versions are the learner's (``pipe.version``'s): ``batch.version`` minus a
    sample's oldest chunk's version is its staleness, with or without a first push of the
    user's own (the channel's pushes counted one more than the updates: -1 for every sample),
    and no chunk is made before any weights (they carried None, counted as staleness 0)."""
    prompts = [{"id": i, "length": 2} for i in range(12)]
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Learner)) as learner,
        _servers() as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):
        if first_push:
            await channel.push()
        async with asyncexec.Pipeline(
            servers, prompts, batch_size=4, staleness=1, channel=channel
        ) as pipe:
            assert pipe.version == 0
            batches = []
            async for batch in pipe:
                batches.append(batch)
                await learner.call(Learner.step)
                await pipe.update_weights()
    assert [b.version for b in batches] == [0, 1, 2]
    for batch in batches:
        for sample, staleness in zip(batch.samples, batch.staleness, strict=True):
            assert None not in sample.versions, sample
            assert sample.version is not None
            assert batch.version - sample.version == staleness, (batch, sample)
            assert 0 <= staleness <= 1
    _check_chunks(batches)  # each chunk ran on the learner's weights of its version


class Gated(Toy):
    """Installs a version from 2 on only once the file ``gate`` exists (the first push, version
    1, at once); version ``refuse`` raises."""

    def __init__(self, gate: str, refuse: int = 0) -> None:
        super().__init__()
        self.gate, self.refuse = Path(gate), refuse

    def load_weights(self, state: Any, version: int) -> None:
        import time

        if version == self.refuse:
            raise RuntimeError(f"refusing version {version}")
        while version >= 2 and not self.gate.exists():
            time.sleep(0.01)
        super().load_weights(state, version)


@pytest.mark.ray_only
@pytest.mark.timeout(90)
async def test_an_update_that_does_not_wait_returns_at_the_read_and_keeps_the_bound(
    mode: str, tmp_path: Path
) -> None:
    """``update_weights(wait=False)`` returns once the learner's state is read: here while
    every server's install of it is held at a gate the test opens only after the call returned
    (had it waited for the delivery, the test would hang). The version is counted at the read;
    the next update waits for the delivery; every prompt is trained once, within the bound,
    each chunk on the weights of the version it is tagged with, and the pipeline's exit waits
    for the last delivery."""
    gate = tmp_path / "open"
    prompts = [{"id": i, "length": 2} for i in range(16)]
    role = asyncexec.Role(Gated, str(gate))
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Learner)) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=role) as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):
        async with asyncexec.Pipeline(
            servers, prompts, batch_size=4, staleness=1, channel=channel
        ) as pipe:
            batches = [await pipe.__anext__()]
            await learner.call(Learner.step)
            assert await pipe.update_weights(wait=False) == 1 == pipe.version
            assert channel.version == 2 and not gate.exists()  # read; held at the gate
            gate.touch()
            async for batch in pipe:
                batches.append(batch)
                await learner.call(Learner.step)
                await pipe.update_weights(wait=False)
        held = await servers.call(asyncexec.method(Gated, Gated.weights_version))
        assert held == [channel.version] * 2  # the exit waited for the last delivery
    assert sorted(i for b in batches for i in b.ids) == list(range(16))
    assert [b.version for b in batches] == list(range(len(batches)))
    assert max(b.staleness_max for b in batches) <= 1
    assert pipe.statistics().beyond_bound == 0
    _check_chunks(batches)


@pytest.mark.ray_only
@pytest.mark.timeout(90)
async def test_a_delivery_that_failed_after_the_update_returned_is_raised_by_the_next_batch(
    mode: str, tmp_path: Path
) -> None:
    """A server whose install of version 2 raises after ``update_weights(wait=False)``
    returned: the next batch (or update) raises the ChannelError, naming the version, with the
    server's error kept; the servers were resumed and the pipeline closes."""
    gate = tmp_path / "open"
    gate.touch()
    prompts = [{"id": i, "length": 2} for i in range(40)]
    role = asyncexec.Role(Gated, str(gate), refuse=2)
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Learner)) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=role) as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):
        with pytest.raises(asyncexec.ChannelError, match="version 2") as raised:
            async with asyncexec.Pipeline(
                servers, prompts, batch_size=4, staleness=1, channel=channel
            ) as pipe:
                async for _ in pipe:
                    await learner.call(Learner.step)
                    await pipe.update_weights(wait=False)
        assert "refusing version 2" in str(raised.value) + repr(raised.value.__cause__)
        assert pipe.version == 1


@pytest.mark.ray_only
@pytest.mark.timeout(90)
@pytest.mark.parametrize("body_raises", [False, True])
async def test_a_delivery_that_failed_as_the_pipeline_ends_is_raised_by_its_exit(
    mode: str, tmp_path: Path, body_raises: bool
) -> None:
    """``update_weights(wait=False)`` as the body's last call, whose delivery fails: the exit
    waited for it and dropped the error (the program ended normally, the servers without the
    version the learner counted). The exit raises it; when the body raised, the body's error
    has it as a note."""
    gate = tmp_path / "open"
    gate.touch()
    role = asyncexec.Role(Gated, str(gate), refuse=2)
    expected = RuntimeError if body_raises else asyncexec.ChannelError
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Learner)) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=role) as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):
        with pytest.raises(expected) as raised:
            async with asyncexec.Pipeline(
                servers, [{"id": i, "length": 2} for i in range(8)], batch_size=4, channel=channel
            ) as pipe:
                await pipe.__anext__()
                await pipe.update_weights(wait=False)
                if body_raises:
                    raise RuntimeError("the learner's step failed")
        if body_raises:
            assert "update_weights(wait=False)" in "".join(raised.value.__notes__)
            assert "ChannelError" in "".join(raised.value.__notes__)
        else:
            assert "version 2" in str(raised.value)
        assert pipe.version == 1


def test_an_update_that_does_not_wait_needs_a_channel() -> None:
    """``wait=False`` without a channel (the state handed in would be installed as the learner
    changes it) and a ``wait`` that is no bool are refused, naming the argument."""

    async def main() -> None:
        async with (
            asyncexec.Executor(1, local=True, roles=asyncexec.Role(Toy)) as servers,
            asyncexec.Pipeline(servers, [{"id": 0, "length": 1}], batch_size=1) as pipe,
        ):
            await pipe.__anext__()
            with pytest.raises(asyncexec.ConfigurationError, match="channel"):
                await pipe.update_weights({"w": 1}, wait=False)
            with pytest.raises(asyncexec.ConfigurationError, match="wait="):
                await pipe.update_weights({"w": 1}, wait="no")  # type: ignore[arg-type]
            assert await pipe.update_weights({"w": 1}) == 1

    anyio.run(main)


@pytest.mark.timeout(30)
async def test_chunks_made_before_any_weights_count_as_version_zero_also_after_a_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a channel, servers that were given no weights generate with their own, which
    stand for the learner's version 0: a pipeline resumed at version 3 hands their samples as
    3 behind (they were counted from the version it started from: 0 behind)."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    resumed = {"format": 1, "version": 3, "watermark": 0, "above": []}
    prompts = [{"id": i, "length": 1} for i in range(4)]
    async with (
        _servers() as servers,
        asyncexec.Pipeline(
            servers, prompts, batch_size=4, staleness=1, mode="aggregate", consumed=resumed
        ) as pipe,
    ):
        [batch] = [b async for b in pipe]
    assert batch.version == 3
    assert all(s.versions == (None,) for s in batch.samples)
    assert batch.staleness == (3, 3, 3, 3)
    assert pipe.statistics().beyond_bound == 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("installed_first", [False, True])
async def test_a_strict_pipeline_resumed_without_weights_says_why_its_samples_are_beyond(
    monkeypatch: pytest.MonkeyPatch, installed_first: bool
) -> None:
    """A strict pipeline resumed at version 3 with no channel handed samples made on the
    servers' own weights 3 behind, beyond its bound of 1, and said nothing (only
    ``beyond_bound`` counted them). It now says why in a warning that names the way out; with
    the learner's weights installed at the resumed version first, every sample is within."""
    from structlog.testing import capture_logs

    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    resumed = {"format": 1, "version": 3, "watermark": 0, "above": []}
    prompts = [{"id": i, "length": 1} for i in range(4)]
    with capture_logs() as logs:
        async with _servers() as servers:
            if installed_first:
                await servers.call(asyncexec.RolloutServer.install_weights, {"w": 3}, 3)
            async with asyncexec.Pipeline(
                servers, prompts, batch_size=4, staleness=1, consumed=resumed
            ) as pipe:
                [batch] = [b async for b in pipe]
    warned = [e for e in logs if e["event"] == "pipeline_unversioned_samples"]
    if installed_first:
        assert batch.staleness == (0, 0, 0, 0) and not warned
    else:
        assert batch.staleness == (3, 3, 3, 3)
        [warning] = warned
        assert warning["log_level"] == "warning" and warning["beyond_bound"] == 4
        assert "RolloutServer.install_weights" in warning["hint"]


# Exactly-once through a driver killed and resumed ---------------------------------------------

DRIVER = str(Path(__file__).with_name("pipeline_driver.py"))


def _drive(checkpoint: Path, kill_after: int | None) -> list[dict[str, Any]]:
    env = dict(os.environ, ASYNCEXEC_LOCAL="1")
    proc = subprocess.Popen(
        [sys.executable, DRIVER, str(checkpoint)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(json.loads(line))
        if kill_after is not None and len(lines) == kill_after:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(30)
    return lines


@pytest.mark.timeout(60)
def test_a_resumed_driver_hands_no_consumed_prompt_again_and_skips_none(
    tmp_path: Path,
) -> None:
    """The driver checkpoints (the ids its learner trained on, the pipeline's state) after
    every second update; it is SIGKILLed after its 5th batch (one batch trained on and not
    checkpointed), then started again from the checkpoint."""
    checkpoint = tmp_path / "checkpoint.json"
    first = _drive(checkpoint, kill_after=5)
    assert len(first) == 5
    saved = json.loads(checkpoint.read_text())
    assert len(saved["trained"]) == 4 * 4  # the 5th batch's ids were not checkpointed
    second = _drive(checkpoint, kill_after=None)
    final = json.loads(checkpoint.read_text())
    trained = final["trained"]
    assert sorted(trained) == list(range(40))  # every prompt once: none twice, none skipped
    assert second[0]["version"] == 4  # the version goes on from the checkpoint
    # The lost batch was handed again; nothing consumed before the checkpoint was.
    assert set(first[4]["ids"]) <= {i for line in second for i in line["ids"]}
    assert not set(saved["trained"]) & {i for line in second for i in line["ids"]}


# What it shows ---------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_statistics_logs_and_metrics_agree_with_bounded_labels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("prometheus_client")
    from structlog.testing import capture_logs

    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    prompts = [{"id": i, "length": 2, "slow": i in (0, 5)} for i in range(12)]
    with metrics_enabled() as registry, capture_logs() as logs:
        async with (
            asyncexec.Executor(2, roles=asyncexec.Role(Toy), name="rollout") as servers,
            asyncexec.Pipeline(servers, prompts, batch_size=4, staleness=1) as pipe,
        ):
            modes = itertools.cycle(["abort", "keep"])
            async for _ in pipe:
                await pipe.update_weights({"w": pipe.version + 1}, on_update=next(modes))
    stats = pipe.statistics()
    assert stats.consumed == 12 and stats.in_flight == 0 and stats.buffer_depth == 0
    assert stats.aborted >= 1 and set(stats.pauses) == {"abort", "keep"}
    assert 0 <= stats.trainer_idle_ratio <= 1 and 0 <= stats.rollout_idle_ratio <= 1
    events = [e["event"] for e in logs if e["event"].startswith("pipeline_")]
    assert events[0] == "pipeline_started" and events[-1] == "pipeline_ended"
    updates = [e for e in logs if e["event"] == "pipeline_update"]
    assert [e["mode"] for e in updates] == ["abort", "keep", "abort"]
    samples = {
        s.labels["event"]: s.value
        for metric in registry.collect()
        if metric.name == "asyncexec_pipeline_samples"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    # Synced at each batch: the last batch's counts.
    assert samples["consumed"] == 12 and samples["admitted"] == stats.admitted
    assert samples["aborted"] == stats.aborted
    labels = {
        key
        for metric in registry.collect()
        if metric.name.startswith("asyncexec_pipeline")
        for s in metric.samples
        for key in s.labels
    }
    assert labels <= {"executor", "router", "event", "mode", "le"}  # no id, no prompt


@pytest.mark.timeout(30)
async def test_a_closed_pipelines_metrics_count_what_came_after_its_last_batch() -> None:
    """Defect: the pipeline's sample counters were synced at each batch only, so the prompts
    admitted (and samples returned) after the last batch were never counted in
    ``asyncexec_pipeline_samples_total``, and its ``in_flight`` gauge kept the requests of its
    last batch or update in flight for ever after it closed. At the close the counters are
    synced and the gauge is 0."""
    pytest.importorskip("prometheus_client")
    from asyncexec.testing import ScriptedServer, SimCluster

    def value(registry: Any, name: str, **labels: str) -> float | None:
        by = {"executor": "rollout", "router": "rollout", **labels}
        found: float | None = registry.get_sample_value(name, by)
        return found

    role = asyncexec.Role(ScriptedServer, chunks=3, delay_s=0.01)
    with metrics_enabled() as registry:
        async with asyncexec.Executor(2, roles=role, cluster=SimCluster(), name="rollout") as ex:
            async with asyncexec.Pipeline(ex, range(100), batch_size=4, staleness=2) as pipe:
                async for _ in pipe:
                    await pipe.update_weights({"w": 1})
                    synced = value(registry, "asyncexec_pipeline_samples_total", event="admitted")
                    with anyio.fail_after(10):  # more admitted than at the batch, then a stop
                        while pipe.statistics().admitted <= (synced or 0):  # noqa: ASYNC110 (its state)
                            await anyio.sleep(0.005)
                    break
            stats = pipe.statistics()
            admitted = value(registry, "asyncexec_pipeline_samples_total", event="admitted")
            assert admitted == stats.admitted > (synced or 0)
            assert value(registry, "asyncexec_pipeline_in_flight") == 0


@pytest.mark.timeout(30)
async def test_a_log_processor_that_raises_at_a_batch_loses_no_batch() -> None:
    """Defect: a sink that raised as a batch was handed (the application's structlog processor,
    under the ``pipeline_batch`` line) raised out of the iteration after the batch's samples
    were taken and counted consumed: the batch was lost (a learner that went on never trained
    on it, and the pipeline's ``state_dict()`` had them consumed). Now the batch is handed and
    the error fails the pipeline, out of its ``async with``."""
    import structlog

    from asyncexec.testing import ScriptedServer, SimCluster

    def refuse_batches(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("event") == "pipeline_batch":
            raise RuntimeError("the application's processor failed")
        return event

    structlog.configure(processors=[refuse_batches, structlog.testing.LogCapture()])
    role = asyncexec.Role(ScriptedServer, chunks=3, delay_s=0.01)
    handed: list[Any] = []
    async with asyncexec.Executor(2, roles=role, cluster=SimCluster()) as servers:
        with pytest.raises(RuntimeError, match="the application's processor failed"):
            async with asyncexec.Pipeline(servers, range(12), batch_size=4) as pipe:
                with anyio.fail_after(10):
                    async for batch in pipe:
                        handed += batch.ids
    assert handed and len(handed) == pipe.statistics().consumed  # every batch taken, handed


@pytest.mark.timeout(30)
async def test_a_closed_pipelines_statistics_are_those_at_its_close() -> None:
    """Simulated servers: read after the pipeline closed (a ``break`` with requests in flight),
    its statistics went on as if it ran: the requests it stopped counted in flight, and the
    time since the close counted in ``elapsed_s`` and in no idle time, so the ratios fell the
    longer one waited to read them (0.32 to 0.04 for the learner's). They stop at the close."""
    from asyncexec.testing import ScriptedServer, SimCluster

    role = asyncexec.Role(ScriptedServer, chunks=3, delay_s=0.01)
    async with asyncexec.Executor(2, roles=role, cluster=SimCluster()) as servers:
        async with asyncexec.Pipeline(servers, range(100), batch_size=4) as pipe:
            async for _ in pipe:
                if pipe.version == 2:
                    break
                await pipe.update_weights({"w": pipe.version + 1})
        closed = pipe.statistics()
        await anyio.sleep(0.2)
        assert pipe.statistics() == closed
    assert closed.in_flight == 0 and closed.consumed == 12 and closed.elapsed_s < 5


class Failing(Toy):
    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[Any]:
        if prompt["id"] == 3:
            raise ValueError("no tokens for prompt 3")
        async for chunk in super().chunks(prompt):
            yield chunk


@pytest.mark.timeout(30)
async def test_a_server_error_ends_the_iteration_with_it_and_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    prompts = [{"id": i, "length": 2} for i in range(8)]
    with pytest.raises(asyncexec.WorkerRaisedError) as raised:
        async with (
            asyncexec.Executor(2, roles=asyncexec.Role(Failing)) as servers,
            asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=1) as pipe,
        ):
            async for _ in pipe:
                await pipe.update_weights({"w": pipe.version + 1})
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(asyncexec.ExecutorStateError, match="closed"):
        await pipe.__anext__()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("second", [0, 1])
async def test_a_request_id_that_repeats_in_the_source_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, second: int
) -> None:
    """Ids repeating in the source were dropped silently (``duplicates`` counted them): a
    prompt the user gave was never trained. Whether the first is still pending or consumed
    already, the repeat ends the iteration with an error naming the id."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")

    async def prompts() -> AsyncIterator[asyncexec.RolloutRequest]:
        yield asyncexec.RolloutRequest(7, {"id": 7, "length": 1})
        yield asyncexec.RolloutRequest(8, {"id": 8, "length": 1})
        if second:  # after the first batch was consumed
            while not consumed.is_set():
                await consumed.wait()
        yield asyncexec.RolloutRequest(7, {"id": 7, "length": 2})

    consumed = asyncio.Event()
    batches = []
    with pytest.raises(asyncexec.ConfigurationError, match="id 7 repeats"):
        async with (
            asyncexec.Executor(1, roles=asyncexec.Role(Toy)) as servers,
            asyncexec.Pipeline(servers, prompts(), batch_size=2, staleness=1) as pipe,
        ):
            async for batch in pipe:
                batches.append(batch.ids)
                consumed.set()
                await pipe.update_weights({"w": pipe.version + 1})
    assert batches in ([], [[7, 8]])


@pytest.mark.timeout(20)
async def test_a_request_id_that_repeats_cancels_the_bodys_await_and_leaves_by_the_exit() -> None:
    """What the docs say (``__anext__``'s said it raised the error): the admission fails the
    pipeline's task group, so the body's current await, a training step here, is cancelled,
    and the error comes out of the ``async with``."""
    from asyncexec.testing import ScriptedServer, SimCluster

    prompts = [asyncexec.RolloutRequest(i % 2, "prompt") for i in range(4)]
    interrupted = False
    with pytest.raises(asyncexec.ConfigurationError, match="id 0 repeats"):
        async with (
            asyncexec.Executor(
                2, roles=asyncexec.Role(ScriptedServer), cluster=SimCluster()
            ) as servers,
            asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=1),
        ):
            try:
                await anyio.Event().wait()  # the learner's step
            except anyio.get_cancelled_exc_class():
                interrupted = True
                raise
    assert interrupted


@pytest.mark.timeout(20)
async def test_a_request_id_that_is_not_hashable_is_an_error_naming_it() -> None:
    """Defect: a ``RolloutRequest`` whose id is a list came out of the pipeline's exit as a bare
    ``TypeError: unhashable type: 'list'``, naming neither the request nor what an id is for.
    It is a ``ConfigurationError`` naming the id and its position."""
    from asyncexec.testing import ScriptedServer, SimCluster

    prompts = [asyncexec.RolloutRequest("a", "prompt"), asyncexec.RolloutRequest([1], "prompt")]
    with pytest.raises(asyncexec.ConfigurationError, match=r"position 1 .*\[1\].*not hashable"):
        async with (
            asyncexec.Executor(
                2, roles=asyncexec.Role(ScriptedServer), cluster=SimCluster()
            ) as servers,
            asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=1) as pipe,
        ):
            async for _ in pipe:
                pass


class RefusesTwo(Toy):
    def load_weights(self, state: Any, version: int) -> None:
        if version == 2:
            raise RuntimeError("version 2 does not load")
        super().load_weights(state, version)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("on_update", ["keep", "abort"])
async def test_a_failed_push_resumes_the_servers_and_keeps_the_version(
    monkeypatch: pytest.MonkeyPatch, on_update: Literal["keep", "abort"]
) -> None:
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    prompts = [{"id": i, "length": 3} for i in range(12)]
    async with (
        asyncexec.Executor(1, roles=asyncexec.Role(RefusesTwo)) as servers,
        asyncexec.Pipeline(
            servers, prompts, batch_size=2, staleness=1, on_update=on_update
        ) as pipe,
    ):
        await pipe.__anext__()
        assert await pipe.update_weights({"w": 1}) == 1
        await pipe.__anext__()
        with pytest.raises(asyncexec.WorkerRaisedError):
            await pipe.update_weights({"w": 2})
        assert pipe.version == 1
        # Generation goes on with the weights it had: the rest of the prompts come.
        async for batch in pipe:
            assert all(v in (None, 1) for s in batch.samples for v in s.versions)
    assert pipe.statistics().consumed == 12


class SlowLoad(Toy):
    def load_weights(self, state: Any, version: int) -> None:
        import time

        time.sleep(1.0)  # a long install: the source answers meanwhile
        super().load_weights(state, version)


@pytest.mark.timeout(30)
async def test_a_prompt_the_source_gives_during_an_update_waits_for_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admission loop was waiting for an async source when the update began; the prompt
    the source then gave was admitted during the update (before: admitted at once)."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    more = anyio.Event()

    async def source() -> AsyncIterator[dict[str, Any]]:
        for i in range(2):
            yield {"id": i, "length": 1}
        await more.wait()
        for i in range(2, 4):
            yield {"id": i, "length": 1}

    async with (
        asyncexec.Executor(1, roles=asyncexec.Role(SlowLoad)) as servers,
        asyncexec.Pipeline(servers, source(), batch_size=2, staleness=1) as pipe,
    ):
        await pipe.__anext__()
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe.update_weights, {"w": 1})
            await anyio.sleep(0.05)  # the update is installing
            more.set()
            await anyio.sleep(0.05)
            assert pipe.statistics().admitted == 2  # not prompt 2 yet: the update goes on
        batch = await pipe.__anext__()
    assert sorted(batch.ids) == [2, 3] and batch.version == 1


class Stalls(Toy):
    """A :class:`Toy` whose prompts marked ``stall`` run until aborted before any weights."""

    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[Any]:
        if prompt.get("stall") and self.weights_version() is None:
            for _ in range(10_000):  # about 50 s: until the update aborts it (between chunks)
                await asyncio.sleep(0.005)
                yield self.weights
        async for chunk in super().chunks(prompt):
            yield chunk


@pytest.mark.timeout(60)
async def test_a_requeued_prompt_does_not_wait_behind_a_slow_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a prompt requeued by an abort waited until the source yielded its next prompt,
    since the admission loop sat in the source's ``anext``: a live source with nothing to give
    (prompts from users) held the batch that needed the requeued prompts. Prompts 0 and 1 run
    until aborted, and then the source has nothing: the abort update requeues 0 and 1, and
    the second batch is theirs while the source still waits."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    asked, more = anyio.Event(), anyio.Event()

    async def live() -> AsyncIterator[dict[str, Any]]:
        for i in range(4):
            yield {"id": i, "length": 1, "stall": i < 2}
        asked.set()  # the pipeline asks for a fifth prompt
        await more.wait()  # a source with nothing to give until the test says

    batches: list[list[int]] = []
    servers = asyncexec.Executor(1, resources_per_worker=CPU, roles=asyncexec.Role(Stalls))
    async with (
        servers,
        asyncexec.Pipeline(servers, live(), batch_size=2, staleness=2, on_update="abort") as pipe,
    ):
        with anyio.fail_after(30):
            async for batch in pipe:
                batches.append(sorted(batch.ids))
                if len(batches) == 1:
                    await asked.wait()
                    await pipe.update_weights({"w": 1})
                else:
                    more.set()  # the source ends
    assert batches == [[2, 3], [0, 1]]
    assert pipe.statistics().requeued == 2
