"""PostgreSQL's notices of new signals: the connection that listens for them, the lock
that makes one listener of the deployment the active one, and the producer's way to
say "I wake the worker myself" (PostgreSQL only; SQLite has no notices).

Every committed ``INSERT`` into ``dream_signals`` sends one notice on :data:`CHANNEL`
(migration 0008): the new ids, comma-separated, or :data:`MARKER_SCAN` when they do not
fit in one notice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from store.db import SessionGuards, safe_url
from worker.errors import DatabaseUnavailable
from worker.settings import Settings

CHANNEL = "dream_signals"
#: The notice's payload when the ids did not fit: scan for every ready signal.
MARKER_SCAN = "*"
#: Longest id list the trigger sends; PostgreSQL's limit for a payload is 8000 bytes.
MAX_PAYLOAD_BYTES = 7900
#: Transaction-local setting a producer sets when it sends its own wake-up.
WOKEN_SETTING = "reverie.woken"
#: Session-level advisory lock held by the active listener ("reverie" + "listen").
LEADER_LOCK_KEY = 0x5245_5645_4C53_4E
#: ``application_name`` of the listening connection, so an operator can find it.
APPLICATION_NAME = "reverie-listener"


@dataclass(frozen=True)
class Notices:
    """What a batch of notices asks for: wake-ups for ``ids``, or a scan if ``scan``."""

    ids: tuple[int, ...] = ()
    scan: bool = False


def parse(payloads: list[str]) -> Notices:
    """Merge notice payloads; anything unreadable counts as a request to scan."""
    ids: set[int] = set()
    for payload in payloads:
        if payload == MARKER_SCAN:
            return Notices(scan=True)
        try:
            ids.update(int(part) for part in payload.split(",") if part)
        except ValueError:
            return Notices(scan=True)
    return Notices(ids=tuple(sorted(ids)))


@contextmanager
def producer_wakes(session: Session) -> Iterator[None]:
    """Inside the block, rows this transaction inserts into ``dream_signals`` send no
    notice: the producer publishes its own wake-up after commit. Reset after the block,
    so the caller's own later INSERTs in the same transaction are notified as usual."""
    if session.get_bind().dialect.name != "postgresql":
        yield
        return
    session.execute(text("SELECT set_config(:name, 'on', true)"), {"name": WOKEN_SETTING})
    # Not in a ``finally``: after an error the transaction is aborted (and the setting
    # ends with it), and one more statement would only hide the original error.
    yield
    session.execute(text("SELECT set_config(:name, 'off', true)"), {"name": WOKEN_SETTING})


def _conninfo(settings: Settings) -> str:
    return make_url(settings.database_url).set(drivername="postgresql").render_as_string(hide_password=False)


class ListenConnection:
    """One autocommit connection of its own (never from a pool): it holds the
    listener's advisory lock for as long as its session lives, so a listener that dies
    releases the lock with its connection. Every method raises
    :class:`DatabaseUnavailable` when the connection is lost."""

    def __init__(self, settings: Settings) -> None:
        self._where = safe_url(settings.database_url)
        guards = SessionGuards.of(settings)
        try:
            self._conn = psycopg.connect(
                _conninfo(settings),
                autocommit=True,
                connect_timeout=5,
                application_name=APPLICATION_NAME,
                # A half-open connection (a host gone without a word) is noticed in
                # seconds, not after the kernel's retransmissions give up: on this
                # side, and on the server's, which otherwise keeps a vanished
                # listener's session, and its advisory lock, for hours.
                **guards.client_args(),
            )
            guards.apply(self._conn)
        except psycopg.Error as exc:
            raise DatabaseUnavailable(self._where, _first_line(exc)) from exc

    def take_lead(self) -> bool:
        """Try to become the active listener; True if this connection now holds the lock."""
        return bool(self._one("SELECT pg_try_advisory_lock(%s)", LEADER_LOCK_KEY))

    def listen(self) -> None:
        self._one(f"LISTEN {CHANNEL}")

    def ping(self) -> None:
        self._one("SELECT 1")

    def receive(self, timeout: float) -> list[str]:
        """The payloads of the notices that arrive within ``timeout`` seconds; returns
        as soon as one has arrived, with the others already waiting."""
        payloads: list[str] = []
        try:
            for notice in self._conn.notifies(timeout=timeout, stop_after=1):
                payloads.append(notice.payload)
            if payloads:
                # Whatever else is buffered now, without waiting for more.
                payloads.extend(notice.payload for notice in self._conn.notifies(timeout=0.0))
        except psycopg.Error as exc:
            raise DatabaseUnavailable(self._where, _first_line(exc)) from exc
        return payloads

    def close(self) -> None:
        with suppress(psycopg.Error):
            self._conn.close()

    def _one(self, query: str, *params: object) -> object:
        try:
            cursor = self._conn.execute(query, params or None)
            row = cursor.fetchone() if cursor.description is not None else None
        except psycopg.Error as exc:
            raise DatabaseUnavailable(self._where, _first_line(exc)) from exc
        return None if row is None else row[0]


def _first_line(exc: BaseException) -> str:
    message = str(exc).strip()
    return message.splitlines()[0] if message else type(exc).__name__
