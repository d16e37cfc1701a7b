"""The staleness budget: how many prompts may be admitted, and which finished samples a batch
takes. Pure: no tasks, no clock (the pipeline drives it; ``tests/pipeline/test_pipeline_units.py``
checks the strict bound under random workloads).

Versions are the learner's: ``v`` counts the updates done. A sample admitted while the servers
hold ``v`` is made by ``v`` or later (versions only go up), so it is counted from ``v`` until it
finishes, then from the version of its oldest chunk. (The servers hold the version before ``v``
while an update counted at its read is delivered, and after that delivery failed: admission
counts from the version they hold, ``installed``.) A sample of version ``u`` may be consumed
up to the batch at version ``u + S`` (its *deadline*); consumed later, it is beyond the bound.

Admission (SkyRL's capacity, counted on what is not consumed): with ``n`` the version of the
next batch the learner owes (``v`` until a batch is handed at ``v``, then ``v + 1``), a prompt
is admitted while the samples admitted and not consumed stay below ``(v + S - n + 1) * B``, so
that every deadline can be met by the batches still to come: for every ``t >= n``, at most
``(t - n + 1) * B`` unconsumed samples have a deadline at or before ``t``.

Strict batches keep that true, which bounds every sample: the batch at ``v`` takes the finished
samples oldest version first, and waits until those ``B`` meet what each future batch needs:
``need(t) = unconsumed(deadline <= t) - (t - v) * B`` of them with a deadline at or before
``t``, for every ``t`` (for ``t = v``: every sample whose deadline is ``v``, those that would
expire after it). For S = 1 that is the rule "the batch contains every sample of version
``v - 1``"; for larger S, checking it for every ``t`` (not only ``t = v``) is what keeps a batch
that took fresh samples from leaving more than ``B`` to expire at once later. Aggregate batches
(SkyRL's) take the ``B`` oldest finished samples as soon as there are ``B``: the bound holds on
aggregate, and the realised staleness is measured.

Expiry (strict mode, S >= 1): when B samples are finished and the batch waits only for samples
in flight that would expire after it, :meth:`expiring` names the deadline up to which those
could be expired instead (cancelled and their prompts requeued: admitted again at ``v`` or
later, their deadline becomes ``v + S`` or later). The pipeline expires the ones it may (not
those requeued too often already) and asks :meth:`ready` again: the bound is :meth:`ready`'s,
expiry only removes samples in flight.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from ..._errors import ExecutorStateError

__all__ = ["Budget"]

T = TypeVar("T")


class Budget(Generic[T]):
    """The admission budget and the buffer of finished samples (``T``: what the pipeline keeps
    of a sample), by version."""

    def __init__(self, batch_size: int, staleness: int, *, strict: bool, version: int = 0) -> None:
        self.batch_size = batch_size
        self.staleness = staleness
        self.strict = strict
        self.start = version  # the version the pipeline started from
        self.version = version  # v: the learner's updates done
        #: The learner's version the servers hold: ``v``, but between the read of an update
        #: that goes on in the background and its delivery, and after such a delivery failed
        #: (until an update succeeds), the one before. Prompts are admitted counted from it.
        self.installed = version
        self.owed = version  # n: the version of the next batch the learner owes
        self.in_flight: Counter[int] = Counter()  # by the version they were admitted at
        self.finished: dict[int, deque[T]] = {}  # by the sample's version, in arrival order

    def __repr__(self) -> str:
        return (
            f"<Budget v={self.version} installed={self.installed} owed={self.owed} "
            f"in_flight={self.in_flight_count} finished={self.finished_count} "
            f"admissible={self.admissible()}>"
        )

    @property
    def in_flight_count(self) -> int:
        return sum(self.in_flight.values())

    @property
    def finished_count(self) -> int:
        return sum(len(q) for q in self.finished.values())

    def admissible(self) -> int:
        """How many prompts may be admitted now."""
        room = (self.installed + self.staleness - self.owed + 1) * self.batch_size
        return max(0, room - self.in_flight_count - self.finished_count)

    def admit(self) -> int:
        """Count one prompt admitted; returns the version it is counted from until it ends."""
        self.in_flight[self.installed] += 1
        return self.installed

    def drop(self, admitted: int) -> None:
        """A prompt admitted at ``admitted`` ended without a sample (aborted, failed)."""
        self.in_flight[admitted] -= 1
        if not self.in_flight[admitted]:
            del self.in_flight[admitted]

    def finish(self, admitted: int, version: int, item: T) -> None:
        """A prompt admitted at ``admitted`` ended with a sample of ``version``."""
        self.drop(admitted)
        self.finished.setdefault(version, deque()).append(item)

    def _deadlines(self) -> Iterator[tuple[int, int, int]]:
        """(deadline, unconsumed with it, finished with it), by deadline."""
        s = self.staleness
        counts: Counter[int] = Counter()
        ready: Counter[int] = Counter()
        for admitted, n in self.in_flight.items():
            counts[admitted + s] += n
        for version, queue in self.finished.items():
            counts[version + s] += len(queue)
            ready[version + s] += len(queue)
        for deadline in sorted(counts):
            yield deadline, counts[deadline], ready[deadline]

    def ready(self, *, final: bool = False) -> bool:
        """Whether a batch can be handed now. ``final``: nothing more will be admitted (the
        source is exhausted), so what is finished goes out once nothing is in flight."""
        finished = self.finished_count
        if finished >= self.batch_size:
            return not self.strict or self._meets_needs()
        return final and finished > 0 and not self.in_flight

    def _meets_needs(self) -> bool:
        """Whether the B oldest finished samples meet every future batch's need, or waiting
        cannot help (no sample in flight could meet a need that is not met)."""
        return not any(waits for _, waits in self._waits())

    def expiring(self) -> int | None:
        """Strict mode, S >= 1, at least B finished and a batch that waits: the latest deadline
        ``t < v + S`` whose need the B oldest finished samples do not meet, so that expiring
        the samples in flight with a deadline at or before ``t`` (their prompts admitted again
        at ``v`` or later, with a deadline of ``v + S`` or later) lets the batch go sooner;
        None otherwise."""
        if not self.strict or not self.staleness or self.finished_count < self.batch_size:
            return None
        cutoff: int | None = None
        for deadline, waits in self._waits(before=self.version + self.staleness):
            if waits:
                cutoff = deadline
        return cutoff

    def _waits(self, before: int | None = None) -> Iterator[tuple[int, bool]]:
        """For each deadline in order (those under ``before``): whether a batch of the B oldest
        finished samples now would leave its need unmet while a sample in flight with that
        deadline or an earlier one could still meet it (then waiting helps)."""
        b, v = self.batch_size, self.version
        unconsumed = taken = in_flight_before = 0
        left = b
        for deadline, count, ready in self._deadlines():
            if before is not None and deadline >= before:
                return
            unconsumed += count
            in_flight_before += count - ready
            take = min(ready, left)
            taken, left = taken + take, left - take
            need = unconsumed - max(0, deadline - v) * b
            yield deadline, taken < need and in_flight_before > 0

    def take(self) -> list[tuple[int, T]]:
        """Hand a batch: up to B finished samples, oldest version first, as (version, item);
        call when :meth:`ready`."""
        batch: list[tuple[int, T]] = []
        for version in sorted(self.finished):
            queue = self.finished[version]
            while queue and len(batch) < self.batch_size:
                batch.append((version, queue.popleft()))
            if not queue:
                del self.finished[version]
            if len(batch) == self.batch_size:
                break
        self.owed = max(self.owed, self.version + 1)
        return batch

    def check_update(self) -> None:
        """Refuse an update that would break the strict bound. One without a batch at ``v``
        goes when the servers do not hold ``v`` (its delivery failed) and no sample would be
        due at ``v``: it delivers the learner's weights again (at S = 0 no batch can come
        before it, since nothing is admitted while the servers hold the version before).

        Raises:
            ExecutorStateError: strict mode, and no batch was handed at the current version.
        """
        if not self.strict or self.owed > self.version:
            return
        due = next((deadline for deadline, _, _ in self._deadlines()), None)
        if self.installed < self.version and (due is None or due > self.version):
            return
        raise ExecutorStateError(
            f"strict mode: update_weights() at version {self.version} before a batch was "
            "taken at it (the bound counts one batch per version at least)"
        )

    def advance(self, *, delivered: bool = True) -> None:
        """The learner's version goes up by one (after an update; ``delivered``: the servers
        hold it, else once :meth:`deliver` says so)."""
        self.version += 1
        self.owed = max(self.owed, self.version)
        if delivered:
            self.installed = self.version

    def deliver(self, version: int) -> None:
        """The servers hold the learner's ``version`` (an update's delivery ended)."""
        self.installed = max(self.installed, version)
