"""The dream leases one run (or one chunk of runs) holds, kept alive while it works.

A heartbeat thread renews every lease the run holds, a quarter of the lease's length
apart, so none runs out while the run waits for a model call or works on another
user of its chunk. A renewal that finds a lease gone (the user was erased, or the
lease ran out while the process was frozen and another run took it) marks that user
lost: the run stops that user's work. The heartbeat alone cannot promise that, as the
whole process may stall between a check and a write; so every write the run makes
for a user happens in a transaction that first re-takes the lease (:meth:`hold`),
which locks the lease's row until that transaction ends.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from types import TracebackType

from sqlalchemy.orm import Session

from store import locks
from store.db import session_scope
from worker.errors import LeaseLost
from worker.logs import get_logger, user_ref
from worker.settings import Settings

log = get_logger(__name__)


class LeaseKeeper:
    """The leases held under ``token`` for ``user_ids``; a context manager that runs the heartbeat."""

    def __init__(
        self,
        settings: Settings,
        token: str,
        ttl: timedelta,
        user_ids: Sequence[str],
        *,
        until: datetime | None = None,
    ) -> None:
        self.settings, self.token, self.ttl = settings, token, ttl
        # user -> the lease's end as last renewed (the database's clock), from the end it
        # was taken with (``until``): a run cut off before its first renewal still knows
        # when its lease ran out, so its ledger row never ends after a later run began.
        self._held: dict[str, datetime | None] = dict.fromkeys(user_ids, until)
        self._lost: dict[str, datetime | None] = {}
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LeaseKeeper:
        # The leases were just taken, each until ``until``: the first renewal is due a
        # quarter of the lease later. (Every write re-takes its lease anyway, so a run
        # that stalled before its first renewal writes nothing for a user it lost.)
        self._thread = threading.Thread(target=self._beat, name="dream-lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """End the heartbeat (before the run's last transaction gives the leases back)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _beat(self) -> None:
        interval = self.ttl.total_seconds() / 4
        while not self._stop.wait(interval):
            self._renew_logged()

    def _renew_logged(self) -> None:
        try:
            self.renew_all()
        except Exception as exc:
            # The database may be away for a moment: the next beat tries again, and
            # the writes' own check (hold) still refuses a lease that ran out.
            log.warning("dream_lease_renewal_failed", error_type=type(exc).__name__)

    def renew_all(self) -> None:
        """Renew every lease still held, now; users whose lease is gone become lost."""
        users = self.held()
        if users:
            with session_scope(self.settings) as session:
                # Rows a transaction holds right now are skipped, not waited for: it may
                # be this run's own write, which re-takes those leases itself.
                kept = locks.renew_many(session, users, self.token, self.ttl, skip_locked=True)
                still = locks.holders(session, users, self.token)
            self._settle([u for u in users if u in kept or u not in still], kept)

    def hold_many(self, session: Session, user_ids: Sequence[str]) -> list[str]:
        """Re-take, inside the caller's write transaction, the leases of ``user_ids``
        still held; returns those users (the others are lost, and get nothing written)."""
        users = [u for u in user_ids if not self.lost(u)]
        kept = locks.renew_many(session, users, self.token, self.ttl)
        self._settle(users, kept)
        return [u for u in user_ids if u in kept]

    def hold(self, session: Session, user_id: str) -> None:
        """:meth:`hold_many` for one user; raises :class:`LeaseLost` if it is gone."""
        if not self.hold_many(session, [user_id]):
            raise LeaseLost(user_ref(user_id, self.settings.log_hash_key))

    def check(self, user_id: str) -> None:
        """Raise :class:`LeaseLost` if the heartbeat found the user's lease gone."""
        if self.lost(user_id):
            raise LeaseLost(user_ref(user_id, self.settings.log_hash_key))

    def held(self) -> list[str]:
        with self._mutex:
            return sorted(self._held)

    def lost(self, user_id: str) -> bool:
        with self._mutex:
            return user_id in self._lost

    def ended_at(self, user_id: str) -> datetime | None:
        """When a lost lease ran out, as last known (None: not known)."""
        with self._mutex:
            return self._lost.get(user_id, self._held.get(user_id))

    def _settle(self, users: Sequence[str], kept: dict[str, datetime]) -> None:
        with self._mutex:
            for user_id in users:
                if user_id in kept and user_id in self._held:
                    self._held[user_id] = kept[user_id]
                elif user_id in self._held:
                    self._lost[user_id] = self._held.pop(user_id)
                    log.warning("dream_lease_lost", user=user_ref(user_id, self.settings.log_hash_key))
