"""The invariants of the group kinds (pools, runs of independent ranks, elastic sizes, weight
channels, named runs that resume): checks of what the scenarios recorded. Pure: no Ray, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncexec
from benchmarks.chaos.invariants import (
    Problem,
    _ranges,
    check_attempts,
    check_checkpoint,
    check_index,
    check_state,
    expected_total,
)

__all__ = [
    "Install",
    "Line",
    "Push",
    "check_channel",
    "check_independent",
    "check_pool",
    "check_resizes",
    "check_resumed",
    "check_sized",
    "check_ticks",
    "independent_complete",
    "sized_complete",
]

#: What a target process installed: (version, tag, source pid, payload intact).
Install = tuple[int, int, int, bool]


@dataclass(frozen=True)
class Push:
    """One ``channel.push()`` as the driver made it: the tag it set on the source first (and the
    source process that took it), then what the push returned or raised, and when."""

    tag: int
    source_pid: int | None
    version: int | None  # None: it raised
    returned: float  # time.time() when it returned or raised
    error: str | None = None  # the name of the exception's type


# Pools ------------------------------------------------------------------------------------------


def check_pool(
    size: int, idle: int, leased: int, idle_pids: Sequence[int], dead_pids: Sequence[int]
) -> list[Problem]:
    """A pool after its executors closed and its refills ended: ``size`` idle workers, none
    leased, and none of them a process that died."""
    problems: list[Problem] = []
    if idle != size or leased != 0 or len(set(idle_pids)) != idle:
        problems.append(
            (
                "pool_refills",
                f"idle {idle} ({len(set(idle_pids))} processes), leased {leased}, size {size}",
            )
        )
    dead = sorted(set(idle_pids) & set(dead_pids))
    if dead:
        problems.append(("no_dead_lease", f"idle workers {dead} are dead processes"))
    return problems


# Independent ranks --------------------------------------------------------------------------------


def check_independent(
    steps: Sequence[asyncexec.Step], *, workers: int, every: int
) -> list[Problem]:
    """An unaligned stream (whole or a prefix): ``Step.index`` counts 0, 1, 2, ...; each step is
    one rank's report, with that rank's attempt, a state an undisturbed run has, a checkpoint
    exactly at multiples of ``every``; per rank, attempts increase, the steps of an attempt are
    consecutive, and a later attempt starts right after that rank's latest checkpoint."""
    problems = check_index(steps)
    rows: dict[int, list[tuple[int, int, bool]]] = {r: [] for r in range(workers)}
    for s in steps:
        if len(s.reports) != 1 or s.rank is None or s.reports[0].rank != s.rank:
            problems.append(("ranks", f"step {s.index} is not one report of its rank"))
            continue
        m = s.reports[0].metrics
        value = m["step"]
        if s.rank not in rows:
            problems.append(("ranks", f"step {s.index} is of rank {s.rank} of {workers}"))
            continue
        if m["attempt"] != s.attempt:
            problems.append(
                ("attempt_number", f"step {s.index} of {s.attempt} from {m['attempt']}")
            )
        problems += check_state(s.reports[0], value)
        problems += check_checkpoint(s, value, every, f"rank {s.rank} step {value}")
        rows[s.rank].append((s.attempt, value, s.checkpoint is not None))
    if problems:
        return problems
    for rank, ranked in rows.items():
        problems += check_attempts(ranked, who=f"rank {rank}: ")
    return problems


def independent_complete(
    steps: Sequence[asyncexec.Step],
    return_values: Sequence[Any],
    *,
    workers: int,
    total: int,
    replaced: frozenset[int],
) -> list[Problem]:
    """A finished run of independent ranks: every rank's every step delivered; a rank that was
    not replaced delivered each step exactly once, all in attempt 1; the return values are an
    undisturbed run's."""
    problems: list[Problem] = []
    for rank in range(workers):
        mine = [s for s in steps if s.rank == rank]
        values = [s.reports[0].metrics["step"] for s in mine]
        lost = sorted(set(range(total)) - set(values))
        if lost:
            problems.append(("no_step_lost", f"rank {rank} never delivered {_ranges(lost)}"))
        if rank not in replaced and (
            values != list(range(total)) or {s.attempt for s in mine} - {1}
        ):
            problems.append(
                (
                    "survivor_untouched",
                    f"rank {rank} (not replaced) delivered {_ranges(values)} "
                    f"in attempts {sorted({s.attempt for s in mine})}",
                )
            )
    expected = [expected_total(r, total - 1) for r in range(workers)]
    if list(return_values) != expected:
        problems.append(
            ("final_state", f"return values {list(return_values)}, expected {expected}")
        )
    return problems


# Elastic sizes ------------------------------------------------------------------------------------


def check_sized(
    steps: Sequence[asyncexec.Step], *, every: int, least: int, most: int
) -> list[Problem]:
    """A stream of ``sized_counter`` (whole or a prefix): indices 0, 1, 2, ...; each step has one
    report per rank of its attempt's group, every rank saying the same step, attempt and world
    size (the step's width, within ``least``..``most``, the same through an attempt) and the
    state an undisturbed run has; a checkpoint exactly at multiples of ``every``; attempts resume
    right after the latest delivered checkpoint."""
    problems = check_index(steps)
    widths: dict[int, set[int]] = {}
    for s in steps:
        ranks = [r.rank for r in s.reports]
        if ranks != list(range(len(ranks))) or not ranks:
            problems.append(("ranks", f"step {s.index} has reports of ranks {ranks}"))
            continue
        said = {(r.metrics["step"], r.metrics["attempt"], r.metrics["world"]) for r in s.reports}
        if len(said) != 1:
            problems.append(("same_step", f"step {s.index} mixes {sorted(said)}"))
            continue
        value, attempt, world = said.pop()
        if attempt != s.attempt:
            problems.append(("attempt_number", f"step {s.index} of {s.attempt} from {attempt}"))
        if world != len(ranks) or not least <= world <= most:
            problems.append(
                (
                    "world_size",
                    f"step {s.index}: {len(ranks)} reports saying world size {world}, "
                    f"bounds {least}..{most}",
                )
            )
        widths.setdefault(s.attempt, set()).add(len(ranks))
        if {r.metrics["total"] for r in s.reports} != {value * (value + 1) // 2}:
            problems.append(("state", f"step {s.index} (function step {value}): wrong totals"))
        problems += check_checkpoint(s, value, every, f"step {s.index} (function step {value})")
    for attempt, sizes in widths.items():
        if len(sizes) > 1:
            problems.append(("world_size", f"attempt {attempt} ran at sizes {sorted(sizes)}"))
    if problems:
        return problems
    rows = [(s.attempt, s.reports[0].metrics["step"], s.checkpoint is not None) for s in steps]
    return check_attempts(rows)


def check_resizes(steps: Sequence[asyncexec.Step], *, most: int) -> list[Problem]:
    """An elastic run that lost a node and got it back: the first attempt ran at ``most``, a
    later one at fewer (the run went on smaller instead of waiting), the last at ``most`` again
    (it grew back)."""
    sizes: dict[int, int] = {}
    for s in steps:
        sizes.setdefault(s.attempt, len(s.reports))
    order = [sizes[a] for a in sorted(sizes)]
    problems: list[Problem] = []
    if not order or order[0] != most:
        problems.append(("started_whole", f"sizes by attempt {order}, expected {most} first"))
    if not any(size < most for size in order[1:]):
        problems.append(("went_on_smaller", f"sizes by attempt {order}: never smaller"))
    if not order or order[-1] != most or len(order) < 3:
        problems.append(("grew_back", f"sizes by attempt {order}, expected {most} last"))
    return problems


def sized_complete(
    steps: Sequence[asyncexec.Step], return_values: Sequence[Any], *, total: int
) -> list[Problem]:
    """A finished ``sized_counter`` run: every step up to the last delivered (at least
    ``total - 1``), and every rank of the last group returning the total at the last step."""
    values = {s.reports[0].metrics["step"] for s in steps if s.reports}
    last = max(values, default=-1)
    problems: list[Problem] = []
    lost = sorted(set(range(max(last + 1, total))) - values)
    if lost:
        problems.append(("no_step_lost", f"function steps never delivered: {_ranges(lost)}"))
    width = len(steps[-1].reports) if steps else 0
    expected = [last * (last + 1) // 2] * width
    if list(return_values) != expected:
        problems.append(
            ("final_state", f"return values {list(return_values)}, expected {expected}")
        )
    return problems


# Weight channels ----------------------------------------------------------------------------------


def check_ticks(
    steps: Sequence[asyncexec.Step], *, workers: int, unaligned: bool = False
) -> list[Problem]:
    """A stream of ``learner`` or ``rollout`` (no checkpoints): indices 0, 1, 2, ...; one report
    per rank (``unaligned``: one report per step, of the step's rank), all of the same step and
    of the step's attempt; every attempt (of each rank, when unaligned) counts from 0."""
    problems = check_index(steps)
    rows: dict[int | None, list[tuple[int, int, bool]]] = {}
    for s in steps:
        ranks = [r.rank for r in s.reports]
        said = {(r.metrics["step"], r.metrics["attempt"]) for r in s.reports}
        want = [s.rank] if unaligned and s.rank in range(workers) else list(range(workers))
        if ranks != want or len(said) != 1:
            problems.append(("same_step", f"step {s.index}: ranks {ranks} said {sorted(said)}"))
        elif s.attempt != next(iter(said))[1]:
            problems.append(("attempt_number", f"step {s.index} of {s.attempt} said {said}"))
        else:
            rows.setdefault(s.rank if unaligned else None, []).append(
                (s.attempt, s.reports[0].metrics["step"], False)
            )
    if problems:
        return problems
    for rank, ranked in rows.items():
        problems += check_attempts(ranked, who="" if rank is None else f"rank {rank}: ")
    return problems


def check_channel(
    steps: Sequence[asyncexec.Step],
    pushes: Sequence[Push],
    installed: Mapping[int, Sequence[Install]],
    *,
    staleness: int = 1,
) -> list[Problem]:
    """What a weight channel's pushes did to the target's stream (``rollout``'s steps) and to
    its processes (``installed``: each target process's installs, by pid).

    - a push returns the next version or raises ChannelError, nothing else; versions increase;
    - each report carries the version its rank held when it called ``report()``: at least what
      the function saw just before, at most what it saw just after;
    - no rank's version goes backwards in the stream (nor to None once it held one);
    - after ``push()`` of version v returned, every report made later holds v - (K - 1) or newer;
    - a version's state is the same wherever it is installed, whole, and for a version a push
      returned, the state the driver tagged on the source process it read;
    - each process installs versions in increasing order.
    """
    problems: list[Problem] = []
    versions = [p.version for p in pushes if p.version is not None]
    for p in pushes:
        if p.error is not None and p.error != "ChannelError":
            problems.append(("push_outcome", f"a push raised {p.error}, not ChannelError"))
    if versions != sorted(set(versions)):
        problems.append(("push_versions", f"push() returned versions {versions}"))
    problems += _check_versions_held(steps, pushes, staleness)
    problems += _check_states(steps, pushes, installed)
    return _dedupe(problems)


def _check_versions_held(
    steps: Sequence[asyncexec.Step], pushes: Sequence[Push], staleness: int
) -> list[Problem]:
    """The versions the target's reports carry: bracketed by what the function saw, never
    backwards, and never older than a push that had returned when the report was made."""
    problems: list[Problem] = []
    held: dict[int, int | None] = {}
    previous: dict[tuple[int, int], asyncexec.Report] = {}
    for s in steps:
        for r in s.reports:
            m, where = r.metrics, f"rank {r.rank} step {r.metrics['step']} (attempt {s.attempt})"
            if m["held"] is not None and (r.version is None or r.version < m["held"]):
                problems.append(
                    (
                        "report_version",
                        f"{where}: Report.version {r.version}, the function held {m['held']} "
                        "before report()",
                    )
                )
            before, after = previous.get((r.rank, s.attempt)), m["after_prev"]
            if before is not None and after is not None and (before.version or 0) > after:
                problems.append(
                    (
                        "report_version",
                        f"{where}: the step before's Report.version is {before.version}, the "
                        f"function held {after} after that report() returned",
                    )
                )
            previous[(r.rank, s.attempt)] = r
            last = held.get(r.rank)
            if last is not None and (r.version is None or r.version < last):
                problems.append(("version_monotone", f"{where}: version {r.version} after {last}"))
            held[r.rank] = r.version if r.version is not None else last
            got = min(m["held"] or 0, r.version or 0)
            late = [p for p in pushes if p.version is not None and m["t"] > p.returned]
            missed = [p for p in late if got < (p.version or 0) - (staleness - 1)]
            if missed:
                p = missed[-1]
                problems.append(
                    (
                        "push_delivered",
                        f"{where} holds version {r.version} (function: {m['held']}), made "
                        f"{m['t'] - p.returned:.3f} s after push() of version {p.version} "
                        "returned",
                    )
                )
    return problems


def _check_states(
    steps: Sequence[asyncexec.Step],
    pushes: Sequence[Push],
    installed: Mapping[int, Sequence[Install]],
) -> list[Problem]:
    """The states installed: one per version wherever it went, whole, the one the driver tagged
    for a version a push returned, and installed in increasing versions by each process."""
    problems: list[Problem] = []
    states: dict[int, set[tuple[int, int]]] = {}
    for s in steps:
        for r in s.reports:
            m = r.metrics
            if m["tag_version"] is not None:
                states.setdefault(m["tag_version"], set()).add((m["tag"], m["source_pid"]))
    for pid, rows in installed.items():
        got = [v for v, _, _, _ in rows]
        if got != sorted(set(got)):
            problems.append(("install_order", f"process {pid} installed versions {got}"))
        for version, tag, source, intact in rows:
            states.setdefault(version, set()).add((tag, source))
            if not intact:
                problems.append(("state_intact", f"process {pid}: version {version} is torn"))
    for version, seen in sorted(states.items()):
        if len(seen) > 1:
            problems.append(("state_matches_version", f"version {version} holds {sorted(seen)}"))
    for p in pushes:
        for tag, source in states.get(p.version or -1, set()):
            if source == p.source_pid and tag != p.tag:
                problems.append(
                    (
                        "state_matches_version",
                        f"version {p.version} holds tag {tag}; the driver set {p.tag} on "
                        f"process {source} before pushing it",
                    )
                )
    return problems


def _dedupe(problems: list[Problem], most: int = 3) -> list[Problem]:
    """At most ``most`` problems of each invariant (one broken promise repeats on every report)."""
    kept: list[Problem] = []
    counts: dict[str, int] = {}
    for name, detail in problems:
        counts[name] = counts.get(name, 0) + 1
        if counts[name] <= most:
            kept.append((name, detail))
        elif counts[name] == most + 1:
            kept.append((name, "... and more like it"))
    return kept


# Named runs that resume ---------------------------------------------------------------------------

#: A step as a driver process printed it: (index, function step, attempt).
Line = tuple[int, int, int]


def check_resumed(
    first: Sequence[Line],
    second: Sequence[Line],
    *,
    checkpoint_index: int | None,
    recorded_attempt: int,
    total: int,
) -> list[Problem]:
    """A named run resumed by a new driver after the first died (or was cancelled).

    The new driver's stream goes on from the step after the latest recorded checkpoint (``c``,
    the index of the step that carried it; None: no checkpoint, from the start): its first step is
    index c + 1 and the function step that came after c's, so an index means the same work in
    both streams; indices and steps then go on one by one to the last step, in attempt
    ``recorded_attempt + 1``.
    """
    problems: list[Problem] = []
    work = {index: value for index, value, _ in first}
    if not second:
        return [("resumed", "the new driver delivered no step")]
    index0, value0, _ = second[0]
    want_index = 0 if checkpoint_index is None else checkpoint_index + 1
    want_value = 0 if checkpoint_index is None else work.get(checkpoint_index, -2) + 1
    if index0 != want_index:
        problems.append(
            (
                "resume_index",
                f"the new driver's first step has index {index0}, expected "
                f"{want_index} (the latest checkpoint was step index {checkpoint_index})",
            )
        )
    if value0 != want_value:
        problems.append(
            (
                "resume",
                f"the new driver's first step is function step {value0}, expected "
                f"{want_value} (after the checkpoint at index {checkpoint_index})",
            )
        )
    clash = [(i, work[i], v) for i, v, _ in second if i in work and work[i] != v]
    if clash:
        i, was, now = clash[0]
        problems.append(
            (
                "index_matches_work",
                f"index {i} was function step {was}, now {now} ({len(clash)} such)",
            )
        )
    indices = [i for i, _, _ in second]
    values = [v for _, v, _ in second]
    if indices != list(range(index0, index0 + len(second))):
        problems.append(("step_index", f"the new driver's indices {_ranges(indices)}"))
    if values != list(range(value0, value0 + len(second))):
        problems.append(("consecutive", f"the new driver's steps {_ranges(values)}"))
    if values[-1] != total - 1:
        problems.append(("no_step_lost", f"the new driver ended at step {values[-1]}"))
    attempts = sorted({a for _, _, a in second})
    if attempts != [recorded_attempt + 1]:
        problems.append(
            (
                "attempt_number",
                f"the new driver's attempts {attempts}, expected {recorded_attempt + 1}",
            )
        )
    return problems
