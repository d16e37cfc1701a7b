"""The worker's interface and the programs around it: the programs asyncexec ships freeze
their heap once their groups have started (docs/operating.md's advice: a full collection of
Ray's heap stalls the loop)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import import_example

import asyncexec
from asyncexec._cli._main import main


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The collector as a fresh program has it (nothing frozen), before and after the test."""
    gc.unfreeze()
    yield
    gc.unfreeze()


# gc.freeze() after start-up ---------------------------------------------------------------------


def reports_the_frozen_heap(config: Any = None) -> None:
    """A run's function (in local mode, a thread of the test's process): how many objects the
    collector holds frozen while the run goes on."""
    asyncexec.report({"frozen": gc.get_freeze_count()})


@pytest.mark.usefixtures("unfrozen")
@pytest.mark.timeout(30)
def test_asyncexec_run_freezes_the_heap_once_the_group_has_started(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Frozen while the run goes on (local mode: the function runs in this process), and
    unfrozen when the command returns (a test, or a program, that calls it in-process gets
    its collector back)."""
    rc = main(
        [
            "run", "test_worker_interface:reports_the_frozen_heap", "--workers", "1",
            "--local", "--json",
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    steps = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(steps) == 1 and steps[0]["metrics"]["frozen"] > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.usefixtures("unfrozen")
@pytest.mark.timeout(30)
async def test_the_service_freezes_the_heap_once_its_pool_is_up() -> None:
    """Its lifespan (no pool here, so no Ray) freezes the heap before it serves, and unfreezes
    it on the way out."""
    pytest.importorskip("starlette")
    service = import_example("service")
    app = service.create_app(pool_size=0)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
