"""Dispatch, pure (no Ray): roles, splits, meshes, targets, the load, merges, and the plan of a
call checked before anything is sent."""

from __future__ import annotations

import functools
import json
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import FrozenInstanceError
from types import SimpleNamespace
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncexec import ConfigurationError, Mesh, Role, concat, least_loaded, rank, scatter
from asyncexec._dispatch._plan import plan_call
from asyncexec._dispatch._role import method_of, roles_of
from asyncexec._dispatch._split import split, split_sizes
from asyncexec._dispatch._targets import ALL, Load
from asyncexec._driver._loads import Loads
from asyncexec._wire._protocol import RoleMethod

# Classes at module level, as users write them (a role's method is found by its class).


class Learner:
    def __init__(self, cfg: dict[str, Any], seed: int = 0) -> None:
        self.cfg = cfg

    def update(self, batch: list[int], lr: float = 0.1) -> int:
        return len(batch)

    def two(self, a: Any, b: Any) -> Any:
        return a, b

    def with_on(self, x: Any, *, on: str = "", merge: str = "") -> Any:
        return x, on, merge

    @staticmethod
    def helper(x: int) -> int:
        return x

    @classmethod
    def build(cls, x: int) -> int:
        return x

    def restore(self, checkpoint: Any) -> None:
        pass


class Critic:
    def value(self, obs: Any) -> Any:
        return obs


class Base:
    def sync(self) -> None:
        pass

    def shared(self) -> None:
        pass


class Actor(Base):
    def shared(self) -> None:  # overrides Base.shared
        pass


class Ref(Base):
    pass


class Other:
    def update(self, batch: Any) -> None:
        pass

    @staticmethod
    def tool(x: Any) -> Any:
        return x


def plain(x: Any, y: Any = None) -> Any:
    return x, y


class Rows:
    """Splits itself: the protocol."""

    def __init__(self, items: Sequence[int]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __asyncexec_split__(self, n: int) -> list[Rows]:
        return [Rows(self.items[i::n]) for i in range(n)]


class Point(NamedTuple):
    x: list[int]
    y: list[int]


LEARNER = Role(Learner, {"lr": 0.1})
CRITIC = Role(Critic)


# Sizes and splits ----------------------------------------------------------------------------


def test_sizes_are_contiguous_and_as_even_as_can_be() -> None:
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert split_sizes(0, 3) == [0, 0, 0]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    with pytest.raises(ConfigurationError):
        split_sizes(3, 0)


def test_a_list_splits_10_over_4_into_3_3_2_2_in_order() -> None:
    parts = split(list(range(10)), 4)
    assert parts == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_fewer_items_than_ranks_gives_empty_parts_of_the_same_type() -> None:
    assert split((1, 2), 4) == [(1,), (2,), (), ()]
    assert all(type(p) is tuple for p in split((1, 2), 4))
    assert split([], 3) == [[], [], []]


def test_a_numpy_array_splits_along_axis_0_into_views_empty_parts_included() -> None:
    array = np.arange(12.0).reshape(6, 2)
    parts = split(array, 4)
    assert [p.shape for p in parts] == [(2, 2), (2, 2), (1, 2), (1, 2)]
    assert all(np.shares_memory(p, array) for p in parts)
    empty = split(np.ones((2, 3), dtype=np.int8), 3)[2]
    assert empty.shape == (0, 3)
    assert empty.dtype == np.int8


def test_a_torch_tensor_splits_along_axis_0_empty_parts_included() -> None:
    tensor = torch.arange(10)
    parts = split(tensor, 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    empty = split(torch.zeros(1, 5, dtype=torch.float16), 2)[1]
    assert isinstance(empty, torch.Tensor)
    assert tuple(empty.shape) == (0, 5)
    assert empty.dtype == torch.float16


def test_a_dict_of_columns_splits_in_lockstep_into_dicts_of_the_same_keys() -> None:
    batch = {"obs": np.arange(5), "act": torch.arange(5), "ids": list("abcde"), "n": {"m": [1] * 5}}
    parts = split(batch, 2)
    assert [list(p) for p in parts] == [["obs", "act", "ids", "n"]] * 2
    assert parts[0]["obs"].tolist() == [0, 1, 2]
    assert parts[1]["act"].tolist() == [3, 4]
    assert parts[1]["ids"] == ["d", "e"]
    assert parts[1]["n"] == {"m": [1, 1]}


def test_a_dict_whose_columns_differ_in_length_is_refused_naming_them() -> None:
    with pytest.raises(ConfigurationError, match=r"'b' has 2 items and 'a' has 3"):
        split({"a": [1, 2, 3], "b": [1, 2]}, 2)


def test_an_object_with_the_protocol_splits_itself() -> None:
    parts = split(Rows(range(5)), 2)
    assert [p.items for p in parts] == [[0, 2, 4], [1, 3]]


def test_the_protocol_must_return_exactly_n_parts() -> None:
    class Bad:
        def __asyncexec_split__(self, n: int) -> list[int]:
            return [1]

    with pytest.raises(ConfigurationError, match=r"Bad.__asyncexec_split__\(3\) returned 1 parts"):
        split(Bad(), 3)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("text", "str"),
        (b"bytes", "bytes"),
        ({1, 2}, "set"),
        (7, "int"),
        ((i for i in range(3)), "generator"),
        (np.float64(1.0), "float64"),
        (np.array(3), "a 0-d ndarray"),
        (torch.tensor(3), "a 0-d Tensor"),
        (Point([1], [2]), "Point, a named tuple"),
    ],
)
def test_what_does_not_split_is_refused_naming_the_argument_and_its_type(
    value: Any, kind: str
) -> None:
    with pytest.raises(ConfigurationError, match=rf"cannot split argument 'batch' \({kind}"):
        plan_call(Learner.update, [scatter(value)], {}, 2, roles=[LEARNER])


@given(st.lists(st.integers(), max_size=60), st.integers(min_value=1, max_value=16))
def test_split_then_concat_gives_back_the_list_and_sizes_differ_by_at_most_one(
    items: list[int], n: int
) -> None:
    parts = split(items, n)
    assert len(parts) == n
    assert concat(parts) == items
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=9))
def test_split_then_concat_gives_back_arrays_and_dicts_of_them(rows: int, n: int) -> None:
    batch = {"a": np.arange(rows * 2).reshape(rows, 2), "t": torch.arange(rows)}
    merged = concat(split(batch, n))
    assert np.array_equal(merged["a"], batch["a"])
    assert torch.equal(merged["t"], batch["t"])


# Merging -----------------------------------------------------------------------------------


def test_concat_merges_lists_tuples_arrays_tensors_and_dicts_key_by_key() -> None:
    assert concat([[1], [2, 3], []]) == [1, 2, 3]
    assert concat([(1,), (2,)]) == (1, 2)
    assert concat([np.ones((1, 2)), np.zeros((2, 2))]).shape == (3, 2)
    assert concat([torch.ones(2), torch.zeros(0)]).tolist() == [1.0, 1.0]
    merged = concat([{"x": [1], "y": np.ones(1)}, {"y": np.zeros(2), "x": [2]}])
    assert merged["x"] == [1, 2]
    assert merged["y"].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("results", "match"),
    [
        ([], "at least one"),
        ([1, 2], "cannot merge the results \\(int\\)"),
        ([[1], (2,)], "list and tuple"),
        ([np.ones(1), torch.ones(1)], "ndarray and Tensor"),
        ([{"a": [1]}, {"b": [2]}], "different keys"),
    ],
)
def test_concat_refuses_what_does_not_merge(results: list[Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        concat(results)


# Roles -------------------------------------------------------------------------------------


def test_a_role_is_a_frozen_value_that_pickles() -> None:
    role = Role(Learner, {"lr": 0.1}, seed=3)
    assert role.cls is Learner
    assert role.args == ({"lr": 0.1},)
    assert role.kwargs == {"seed": 3}
    assert role == Role(Learner, {"lr": 0.1}, seed=3)
    assert role != Role(Learner, {"lr": 0.2}, seed=3)
    assert repr(role) == "Role(Learner, {'lr': 0.1}, seed=3)"
    with pytest.raises(FrozenInstanceError):
        role.cls = Critic  # type: ignore[misc, assignment]
    again = pickle.loads(pickle.dumps(role))
    assert again == role
    assert hash(again) == hash(role)


def test_a_role_is_checked_when_made() -> None:
    with pytest.raises(ConfigurationError, match="takes a class, got function"):
        Role(plain)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="missing a required argument: 'cfg'"):
        Role(Learner)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match=r"keyword argument 'seed' \(lock\) cannot be"):
        Role(Learner, {}, seed=threading.Lock())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"argument 0 \(lock\) cannot be pickled"):
        Role(Learner, threading.Lock())  # type: ignore[arg-type]


def test_roles_are_normalised_from_a_role_a_class_or_a_list() -> None:
    assert roles_of(None) == ()
    assert roles_of(LEARNER) == (LEARNER,)
    assert roles_of(Critic) == (Role(Critic),)
    assert roles_of([LEARNER, Critic]) == (LEARNER, Role(Critic))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], "empty list"),
        ([LEARNER, Role(Learner, {"lr": 1})], "two roles of Learner"),
        ([LEARNER, "Critic"], "got str"),
        ("Learner", "got str"),
        (plain, "got function"),
    ],
)
def test_bad_roles_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        roles_of(value)


def test_a_method_is_found_in_its_role_inherited_methods_too() -> None:
    roles = roles_of([CRITIC, LEARNER, Actor])
    assert method_of(Learner.update, roles) == RoleMethod(1, "update")
    assert method_of(Critic.value, roles) == (0, "value")
    assert method_of(Base.sync, roles) == (2, "sync")  # Actor inherits it
    assert method_of(Actor.sync, roles) == (2, "sync")


def test_static_and_class_methods_of_a_role_are_its_methods() -> None:
    assert method_of(Learner.helper, [LEARNER]) == (0, "helper")
    assert method_of(Learner.build, [LEARNER]) == (0, "build")


def test_plain_functions_and_callables_are_not_methods() -> None:
    assert method_of(plain, [LEARNER]) is None
    assert method_of(lambda x: x, [LEARNER]) is None
    assert method_of(print, [LEARNER]) is None
    assert method_of(Other.tool, [LEARNER]) is None  # a static method needs no instance
    assert method_of(Learner({}).update, [LEARNER]) is None  # bound to a driver's object


def test_a_method_of_another_class_is_refused_naming_the_class_and_the_roles() -> None:
    with pytest.raises(ConfigurationError, match=r"Other.update is a method of Other, .*Learner"):
        method_of(Other.update, [LEARNER])
    with pytest.raises(ConfigurationError, match=r"roles: none"):
        method_of(Other.update, [])


def test_a_base_method_that_a_role_overrides_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigurationError, match=r"Actor overrides it: name Actor.shared"):
        method_of(Base.shared, roles_of(Actor))


def test_a_method_two_roles_inherit_is_refused_as_ambiguous() -> None:
    with pytest.raises(ConfigurationError, match=r"several roles \(Actor, Ref\)"):
        method_of(Base.sync, roles_of([Actor, Ref]))


# Meshes and targets --------------------------------------------------------------------------


def test_a_mesh_is_row_major() -> None:
    mesh = Mesh({"dp": 2, "tp": 2})
    assert mesh.size == 4
    assert [mesh.coords(r) for r in range(4)] == [
        {"dp": 0, "tp": 0},
        {"dp": 0, "tp": 1},
        {"dp": 1, "tp": 0},
        {"dp": 1, "tp": 1},
    ]
    assert mesh.ranks(tp=0) == [0, 2]
    assert mesh.ranks(dp=1) == [2, 3]
    assert mesh.ranks(dp=1, tp=0) == [2]
    assert mesh.ranks() == [0, 1, 2, 3]
    big = Mesh({"pp": 2, "dp": 3, "tp": 4})
    assert big.coords(17) == {"pp": 1, "dp": 1, "tp": 1}
    assert all(big.ranks(**big.coords(r)) == [r] for r in range(24))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Mesh({}), "mapping of axis sizes"),
        (lambda: Mesh({"dp": 0}), "size 0"),
        (lambda: Mesh({"dp": True}), "size True"),
        (lambda: Mesh({"dp": 2}, collect={"tp": 0}), "no axis 'tp'"),
        (lambda: Mesh({"dp": 2}, collect={"dp": 2}), "outside the axis"),
        (lambda: Mesh({"dp": 2}).coords(2), "not a rank"),
        (lambda: Mesh({"dp": 2}).ranks(dp=-1), "outside the axis"),
        (lambda: least_loaded(max_in_flight=0), "positive int"),
        (lambda: rank(-1), "at least 0"),
    ],
)
def test_bad_meshes_and_targets_are_refused(make: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        make()


def test_meshes_compare_by_value() -> None:
    assert Mesh({"dp": 2, "tp": 2}, collect={"tp": 0}) == Mesh(
        {"dp": 2, "tp": 2}, collect={"tp": 0}
    )
    assert Mesh({"dp": 2, "tp": 2}) != Mesh({"tp": 2, "dp": 2})
    assert len({Mesh({"dp": 2}), Mesh({"dp": 2})}) == 1
    assert repr(Mesh({"dp": 2}, collect={"dp": 1})) == "Mesh({'dp': 2}, collect={'dp': 1})"


def test_load_chooses_the_least_loaded_lowest_rank_and_respects_the_cap() -> None:
    load = Load(3)
    assert load.choose() == 0
    load.started(0)
    assert load.choose() == 1
    load.started(1)
    load.started(2)
    assert load.choose() == 0  # all at 1: the lowest rank
    assert load.choose(max_in_flight=1) is None  # all at the cap
    load.finished(1)
    assert load.choose(max_in_flight=1) == 1
    assert load.choose(exclude={1}) == 0
    assert load.choose(max_in_flight=1, exclude={1}) is None
    assert load.counts == (1, 0, 1)
    assert load.in_flight(1) == 0
    with pytest.raises(ValueError, match="no call in flight"):
        load.finished(1)


# The plan of a call --------------------------------------------------------------------------


def _calls(
    plan: Any, parts: Sequence[Any] | None = None
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [plan.arguments(r, parts) for r in plan.ranks]


def test_the_same_arguments_go_to_every_rank_as_one_shared_part_each() -> None:
    big = list(range(1000))
    plan = plan_call(Learner.update, [big], {"lr": 0.5}, 3, roles=[LEARNER])
    assert plan.method == (0, "update")
    assert plan.parts == (big, 0.5)
    assert plan.ranks == plan.returned == (0, 1, 2)
    assert _calls(plan) == [((big,), {"lr": 0.5})] * 3
    assert plan.result(["a", "b", "c"]) == ["a", "b", "c"]


def test_one_object_passed_twice_is_one_part() -> None:
    state = {"w": [1, 2]}
    plan = plan_call(Learner.two, [state, state], {}, 2, roles=[LEARNER])
    assert len(plan.parts) == 1
    assert plan.parts_of(0) == plan.parts_of(1) == (0, 0)


def test_each_rank_receives_references_to_its_own_part() -> None:
    plan = plan_call(Learner.update, [scatter(list(range(10)))], {"lr": 0.1}, 4, roles=[LEARNER])
    assert plan.parts == ([0, 1, 2], [3, 4, 5], [6, 7], [8, 9], 0.1)
    refs = [f"ref{i}" for i in range(len(plan.parts))]  # what the driver put in the store
    assert _calls(plan, refs) == [
        (("ref0",), {"lr": "ref4"}),
        (("ref1",), {"lr": "ref4"}),
        (("ref2",), {"lr": "ref4"}),
        (("ref3",), {"lr": "ref4"}),
    ]


def test_scattered_arguments_split_in_lockstep_and_must_match_in_length() -> None:
    plan = plan_call(plain, [scatter([1, 2, 3])], {"y": scatter(["a", "b", "c"])}, 2)
    assert _calls(plan) == [(([1, 2],), {"y": ["a", "b"]}), (([3],), {"y": ["c"]})]
    with pytest.raises(
        ConfigurationError, match=r"argument 'y' has 2 items and argument 'x' has 3"
    ):
        plan_call(plain, [scatter([1, 2, 3])], {"y": scatter([1, 2])}, 2)


async def _kept(value: Any) -> Any:
    return value


async def test_a_torch_part_travels_without_the_rest_of_its_storage() -> None:
    """A torch view pickles its whole storage: a part travels as a copy of its rows only (the
    plan copies nothing; the copy is made as the parts are sent, off the loop when large)."""
    tensor = torch.zeros(1000, 4)
    plan = plan_call(plain, [scatter(tensor)], {}, 4)
    assert all(p.untyped_storage().nbytes() == 1000 * 4 * 4 for p in plan.parts)  # views
    for inline in (0, 1 << 20):  # put (compacted in a thread) and inline
        parts = await plan.travelling(_kept, inline)
        for part in parts:
            assert part.untyped_storage().nbytes() == 250 * 4 * 4
        whole = len(pickle.dumps(tensor))
        assert all(len(pickle.dumps(p)) < whole / 3 for p in parts)
    columns = await plan_call(plain, [scatter({"x": tensor})], {}, 4).travelling(_kept, 0)
    assert all(p["x"].untyped_storage().nbytes() == 250 * 4 * 4 for p in columns)


def test_on_a_mesh_an_axis_scatter_replicates_along_the_other_axes_sharing_parts() -> None:
    mesh = Mesh({"dp": 2, "tp": 2}, collect={"tp": 0})
    batch = np.arange(6)
    plan = plan_call(Learner.update, [scatter(batch, axis="dp")], {}, 4, mesh, roles=[LEARNER])
    assert len(plan.parts) == 2  # one per dp coordinate, each shared by its tp ranks
    assert [plan.parts_of(r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert plan.ranks == (0, 1, 2, 3)
    assert plan.returned == (0, 2)
    assert plan.returns(0) and not plan.returns(1)
    assert plan.result(["r0", "r1", "r2", "r3"]) == ["r0", "r2"]


def test_on_a_mesh_a_scatter_without_axis_splits_over_every_rank() -> None:
    plan = plan_call(plain, [scatter(list(range(8)))], {"y": 1}, 4, Mesh({"dp": 2, "tp": 2}))
    assert [a[0][0] for a in _calls(plan)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_mesh_with_two_axes_scattered_gives_each_rank_its_block() -> None:
    mesh = Mesh({"dp": 2, "tp": 3})
    plan = plan_call(
        plain, [scatter(["d0", "d1"], axis="dp")], {"y": scatter([0, 1, 2], axis="tp")}, 6, mesh
    )
    assert len(plan.parts) == 5
    assert [(a[0][0], a[1]["y"]) for a in _calls(plan)] == [
        (["d0"], [0]),
        (["d0"], [1]),
        (["d0"], [2]),
        (["d1"], [0]),
        (["d1"], [1]),
        (["d1"], [2]),
    ]


def test_merge_concatenates_the_returned_results() -> None:
    plan = plan_call(plain, [scatter([1, 2, 3])], {}, 2, merge=concat)
    assert plan.result([[10, 20], [30]]) == [10, 20, 30]


def test_one_rank_targets_return_one_result() -> None:
    plan = plan_call(plain, ["prompt"], {}, 4, least_loaded(max_in_flight=8, retry=True))
    assert plan.single
    assert plan.ranks == ()
    assert plan.choose == least_loaded(max_in_flight=8, retry=True)
    assert plan.arguments(3) == (("prompt",), {})
    assert plan.returns(3)
    assert plan.result(["out"]) == "out"
    plan = plan_call(plain, ["prompt"], {}, 4, rank(2))
    assert (plan.ranks, plan.returned, plan.single) == ((2,), (2,), True)


def test_partial_keywords_reach_a_method_whose_own_keywords_are_on_and_merge() -> None:
    fn = functools.partial(Learner.with_on, on="mine", merge="also")
    plan = plan_call(fn, [1], {}, 2, roles=[LEARNER])
    assert plan.fn is Learner.with_on
    assert plan.method == (0, "with_on")
    assert plan.arguments(0) == ((1,), {"on": "mine", "merge": "also"})
    plan = plan_call(functools.partial(plain, 5), [], {"y": 6}, 1)
    assert plan.arguments(0) == ((5,), {"y": 6})


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: plan_call(Learner.update, [], {}, 2, roles=[LEARNER]), "missing a required"),
        (lambda: plan_call(Learner.update, [1, 2, 3], {}, 2, roles=[LEARNER]), "too many"),
        (
            lambda: plan_call(Learner.update, [scatter([1])], {"bad": 1}, 2, roles=[LEARNER]),
            "unexpected keyword argument 'bad'",
        ),
        (lambda: plan_call(Learner.helper, [], {}, 2, roles=[LEARNER]), "missing a required"),
        (lambda: plan_call(Other.update, [1], {}, 2, roles=[LEARNER]), "method of Other"),
        (
            lambda: plan_call(functools.partial(Learner.update, 1), [], {}, 2, roles=[LEARNER]),
            "binds positional arguments",
        ),
        (lambda: plan_call(plain, [1], {}, 4, Mesh({"dp": 3})), "has 3 ranks but the group has 4"),
        (lambda: plan_call(plain, [scatter([1], axis="dp")], {}, 2), "on=Mesh"),
        (
            lambda: plan_call(plain, [scatter([1], axis="pp")], {}, 2, Mesh({"dp": 2})),
            "no such axis",
        ),
        (lambda: plan_call(plain, [scatter([1])], {}, 2, least_loaded()), "calls one"),
        (lambda: plan_call(plain, [scatter([1])], {}, 2, rank(0)), "calls one"),
        (lambda: plan_call(plain, [1], {}, 2, rank(2)), "the group has 2 ranks"),
        (lambda: plan_call(plain, [1], {}, 2, rank(1), merge=concat), "returns one"),
        (lambda: plan_call(plain, [1], {}, 2, merge="concat"), "takes a callable"),  # type: ignore[arg-type]
        (lambda: plan_call(plain, [[scatter([1])]], {}, 2), "holds a scatter"),
        (lambda: plan_call(plain, [1], {}, 2, "everyone"), "on= takes"),  # type: ignore[arg-type]
        (lambda: plan_call(plain, [1], {}, 0), "at least one rank"),
    ],
)
def test_bad_calls_are_refused_before_anything_is_sent(call: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        call()


def test_all_is_the_default_target() -> None:
    assert plan_call(plain, [1], {}, 2).ranks == plan_call(plain, [1], {}, 2, ALL).ranks == (0, 1)


def test_dispatch_imports_neither_numpy_nor_torch_nor_the_driver() -> None:
    code = (
        "import ray._private.worker as w\nw.global_worker.mode = w.WORKER_MODE\n"
        "import sys, json\nimport asyncexec._dispatch._plan\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "asyncexec._dispatch._plan" in modules
    assert not {"numpy", "torch", "anyio", "asyncexec._driver"} & set(modules)


# The load record, without an executor ----------------------------------------------------


class _Group:
    def __init__(self, size: int) -> None:
        self.workers = [object()] * size


async def test_each_group_keeps_its_own_load_record() -> None:
    """A waiter of a replaced group does not reset the live group's record (the cap holds)."""
    loads = Loads()
    old, live = _Group(1), _Group(1)
    loads.of(live).started(0)
    loads.of(old)  # a caller of the replaced group, woken
    assert loads.of(live).in_flight(0) == 1
    assert loads.of(live).choose(1) is None


async def test_a_freed_slot_wakes_a_waiter_and_counts_stay_exact() -> None:
    loads = Loads()
    group = _Group(2)
    first = loads.take(group, max_in_flight=1)
    second = loads.take(group, max_in_flight=1)
    assert first is not None and second is not None
    assert (first[1], second[1]) == (0, 1)
    assert loads.take(group, max_in_flight=1) is None
    woken: list[int | None] = []

    async def waiter() -> None:
        handed = await loads.wait_slot()  # the freed slot, handed over (counted still)
        woken.append(None if handed is None else handed[1])

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        loads.release(*second)
    assert woken == [1]
    assert loads.of(group).counts == (1, 1)
    assert loads.in_flight(group) == (1, 1)
    assert loads.in_flight(_Group(3)) == (0, 0, 0)


async def test_a_renewal_is_made_once_per_dead_worker() -> None:
    """However many calls saw a worker die, one renewal is made, in the task group handed in:
    the calls go on at once, and the renewal is under way for calls to that worker until it
    ends."""
    loads = Loads()
    made: list[int] = []
    gate = anyio.Event()

    async def renew() -> None:
        made.append(1)
        await gate.wait()

    workers = [SimpleNamespace(handle=SimpleNamespace(key=k)) for k in ("alive", "dead")]
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            with anyio.fail_after(1):  # none waits for the renewal
                await loads.renew_once("dead", renew, tg)
        await anyio.wait_all_tasks_blocked()
        assert made == [1]
        assert loads.renewing(workers, [0]) is None
        done = loads.renewing(workers, [0, 1])
        assert done is not None and loads.renewing_ranks(workers) == [1]
        gate.set()
        await done.wait()
    assert loads.renewing(workers, [0, 1]) is None and loads.renewing_ranks(workers) == []
