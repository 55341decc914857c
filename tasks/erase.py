"""``reverie erase-user``: the right to erasure (docs/reference.md, Command line)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

from sqlalchemy.orm import Session

from store import erase as erase_store
from store import locks
from store.db import committing, give_back, retrying_conflicts, session_scope
from store.models import UserState
from tasks.leases import LeaseKeeper
from worker.errors import LeaseLost, UserBusy
from worker.keymatch import key_forms
from worker.logs import get_logger, user_ref
from worker.payloads import check_lookup
from worker.settings import Settings

log = get_logger(__name__)

#: How long the erasure's own lease lasts between renewals: it is renewed while the
#: erasing transaction waits, which removes it with the rest of the user's schedule row.
ERASE_LEASE = timedelta(minutes=5)
POLL_SECONDS = 0.1


def erase_user(
    settings: Settings,
    user_id: str,
    *,
    wait_seconds: float | None = None,
    on_wait: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Remove every row about ``user_id`` in one transaction; rows removed per table.

    Signals for the user enqueued before this call are dropped (including one a worker
    is processing: it finds its signal gone and writes nothing); signals enqueued
    afterwards are processed as usual.

    A dream run for the user in progress is waited for first (the erasure takes the
    user's dream lease, as a run does, and holds it until everything is gone): a run's
    last writes, such as its ledger row and the user's next dream time, would otherwise
    land after the erasure. The wait lasts at most ``wait_seconds`` (default: the longest
    a healthy run holds a user, :func:`lease_wait`); then
    :class:`~worker.errors.UserBusy` is raised and nothing is erased. ``on_wait`` is
    called once when the erasure starts waiting. Raises
    ``InvalidSignal`` for an empty or malformed user id (one of spaces alone is a user's).
    """
    check_lookup("user_id", user_id)
    deadline = time.monotonic() + (lease_wait(settings) if wait_seconds is None else wait_seconds)
    first_had_schedule: bool | None = None
    while True:
        taking = _take_lease(settings, user_id, deadline, on_wait)
        token, had_schedule = taking.token, not taking.made_row
        # A second try finds the row its first lease made: not the user's data either.
        first_had_schedule = had_schedule if first_had_schedule is None else first_had_schedule
        # Given back on failure with that row too, whichever try made it.
        taking.made_row = not first_had_schedule
        # Renewed while the erasing transaction waits for the user's rows: a dream run
        # must not take the user over meanwhile. Re-taken in that transaction, so an
        # erasure whose lease ran out anyway (a frozen process) is rolled back and tried again.
        try:
            # Run again, holding the lease, where the database chose it as a deadlock's
            # victim: nothing of it was written.
            counts = retrying_conflicts(partial(_erase_holding, settings, user_id, token))
        except LeaseLost:
            log.info("erase_lease_lost", user=user_ref(user_id, settings.log_hash_key))
            continue
        except BaseException:
            # Nothing erased (or, where the commit's reply was lost, everything, the
            # lease's row included): the lease goes back now, with the schedule row it
            # made for a user that had none, not when it runs out minutes later, holding
            # the user's dreams off until then.
            give_back(settings, taking.give_back, within=5.0)
            raise
        break
    if not first_had_schedule and counts.get(UserState.__tablename__):
        counts[UserState.__tablename__] -= 1  # the row the lease itself made: not the user's data
    log.info("user_erased", user=user_ref(user_id, settings.log_hash_key), rows=sum(counts.values()))
    return counts


def _erase_holding(settings: Settings, user_id: str, token: str) -> dict[str, int]:
    """One transaction erasing the user, under the erasure's lease ``token``."""
    with LeaseKeeper(settings, token, ERASE_LEASE, [user_id]) as keeper, session_scope(settings) as session:
        return erase_store.erase_user(
            session, settings, user_id, hold=lambda s: keeper.hold(s, user_id), key_forms=key_forms(settings)
        )


def lease_wait(settings: Settings) -> float:
    """How long an erasure waits for a dream run by default: the longest a healthy run
    holds the user (:func:`tasks.dream.longest_hold`); a crashed run's lease has expired
    long before."""
    from tasks.dream import longest_hold

    return longest_hold(settings)


@dataclass
class _Taking:
    """An erasure's lease being taken: its token, and whether the transaction taking it
    made the user's schedule row (the user had none)."""

    user_id: str
    token: str = field(default_factory=lambda: str(uuid.uuid4()))
    made_row: bool = False

    def give_back(self, session: Session) -> None:
        """Give the lease back after a commit whose reply was lost, with the row it made
        (a row someone else made meanwhile, a dream run's, stays)."""
        if self.made_row:
            locks.forget(session, self.user_id, self.token)
        else:
            locks.release(session, self.user_id, self.token)


def _take_lease(
    settings: Settings, user_id: str, deadline: float, on_wait: Callable[[], None] | None = None
) -> _Taking:
    """Take the user's dream lease, waiting until ``deadline`` for a run that holds it:
    its token, and whether taking it made the user's schedule row (the user had none)."""
    taking = _Taking(user_id)
    logged = False
    while True:
        # A lease taken by a commit whose reply was lost is given back at once: the
        # erasure's retry would otherwise wait out its own lease (and count the row
        # this lease made as the user's).
        with committing(settings, taking.give_back) as session:
            # Whether the row is the lease's own is told by the statement that takes it:
            # a dream run may make the row while the erasure waits.
            took = locks.take(session, user_id, taking.token, ERASE_LEASE)
            taking.made_row = took.made_row
            if took.taken:
                return taking
        if time.monotonic() >= deadline:
            raise UserBusy(user_ref(user_id, settings.log_hash_key))
        if not logged:
            log.info("erase_waits_for_dream_run", user=user_ref(user_id, settings.log_hash_key))
            if on_wait is not None:
                on_wait()
            logged = True
        time.sleep(POLL_SECONDS)
