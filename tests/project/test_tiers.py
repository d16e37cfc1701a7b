"""The tiers are set by what a test uses (tests/conftest.py), and run in order: the collected
session, read from inside one of its tests."""

from __future__ import annotations

import pytest
from conftest import TIERS, stops_shared_ray, tier_of


def _tiers(items: list[pytest.Item]) -> dict[str, str]:
    return {item.nodeid: tier_of(item) for item in items}


def test_each_test_has_exactly_the_marker_of_its_tier(request: pytest.FixtureRequest) -> None:
    for item in request.session.items:
        marked = [t for t in TIERS if item.get_closest_marker(t) is not None]
        assert marked == [tier_of(item)], item.nodeid


def test_tiers_follow_what_a_test_uses(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        tier = tier_of(item)
        if "make_cluster" in names:
            assert tier == "multinode", item.nodeid
        elif "ray_engines" in names:
            assert tier == "engine", item.nodeid
        elif "ray_local" in names:
            assert tier in ("ray", "subprocess", "bench"), item.nodeid
        elif tier != "fast":
            assert tier in ("subprocess", "bench") or "mode" in names, item.nodeid
    tiers = _tiers(items)
    assert tiers[request.node.nodeid] == "fast"
    known = [
        # a helper of the test's module starts the driver process
        ("test_resume.py::test_a_new_driver_resumes_a_named_run", "subprocess"),
        ("test_cluster.py::test_parent_placement_group_that_captures", "multinode"),
        ("test_engines_vllm.py::test_a_push_changes_greedy_outputs", "engine"),
        ("test_stream.py::test_every_rank_every_step_arrives_in_order_exactly_once[ray", "ray"),
        ("test_stream.py::test_every_rank_every_step_arrives_in_order_exactly_once[local", "fast"),
    ]
    for prefix, tier in known:
        for nodeid in tiers:  # a run of one file or tier holds only some of them
            if nodeid.rpartition("/")[2].startswith(prefix):
                assert tiers[nodeid] == tier, nodeid


def test_the_tiers_run_in_order(request: pytest.FixtureRequest) -> None:
    order = [TIERS.index(tier_of(item)) for item in request.session.items]
    assert order == sorted(order)


def test_the_tests_that_stop_the_shared_ray_run_next_to_each_other(
    request: pytest.FixtureRequest,
) -> None:
    """So that the shared Ray starts again once after them, not after each."""
    items = request.session.items
    stopping = [i for i, item in enumerate(items) if stops_shared_ray(item)]
    if stopping:  # (none when the selection holds none of them)
        assert stopping == list(range(stopping[0], stopping[0] + len(stopping))), stopping
    known = (
        "test_benchmarks.py::test_quick_benchmark_prints_every_row_and_cleans_up",
        "test_grpo.py::test_the_docs_picture_and_a_driver_started_again_from_the_learners_checkpoint",
        "test_pipeline_bench.py::test_quick_pipeline_benchmark_prints_every_figure_and_cleans_up",
    )
    for item in items:  # a run of one file or tier holds only some of them
        if item.nodeid.rpartition("/")[2].startswith(known):
            assert stops_shared_ray(item), item.nodeid


def test_the_suites_ray_lives_in_a_temp_folder_of_its_own(ray_local: None) -> None:
    """Defect: a cluster killed before its shutdown leaves its address in
    ``/tmp/ray/ray_current_cluster``, and ``ray.init()`` without an address joins the cluster
    that file names; a CI run whose /tmp held such a file failed 360 tests, every Ray of the
    suite waiting on a dead GCS. The suite's Ray (and its subprocesses', which inherit
    ``RAY_TMPDIR``) lives in a folder of this session's, where no other cluster leaves one."""
    import os

    import ray

    own = os.environ.get("RAY_TMPDIR")
    assert own and os.path.realpath(own) != os.path.realpath("/tmp"), own
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    assert os.path.realpath(session_dir).startswith(os.path.realpath(own) + os.sep), session_dir
