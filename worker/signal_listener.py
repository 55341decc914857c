"""The signal listener: PostgreSQL's notices of new signals, turned into wake-ups.

A producer in any language that only INSERTs a row into ``dream_signals`` is picked up
as fast as one that uses the Python helper: the table's trigger sends a notice on
commit, and the listener publishes the ``signals.process`` wake-ups.

It runs as a thread in every worker's main process, started once the pool is up.
Only one listener of the deployment is active at a time: the one whose listening
connection holds a session-level advisory lock. The others retry the lock every
``signal_listener_retry_seconds``; when the active worker dies, its lock goes with its
connection and another takes over. Two active at once, or none for a while, cost only
latency or duplicate wake-ups, which are harmless (a signal is claimed once); beat's
sweeper stays as the net.

Notices sent while nobody listens are lost, so on every (re)connect, and after the
broker was away, the listener first wakes everything that is ready (a sweep with no
grace). The connection is checked between notices, and a lost database or broker is
retried with backoff; nothing here ever stops the worker.
"""

from __future__ import annotations

import threading
from typing import Any

from celery import signals

from schedules.sweeper import stranded
from store.notices import ListenConnection, Notices, parse
from worker.errors import BrokerUnavailable, DatabaseUnavailable, SchemaMissing
from worker.logs import get_logger
from worker.settings import Settings, get_settings
from worker.wakeup import wake_signals

log = get_logger(__name__)

#: Seconds between checks that the listening connection is alive, when all is quiet.
HEARTBEAT_SECONDS = 5.0
#: Wake-ups per publish call, so a bulk insert is sent in a few round trips.
BATCH = 500
#: Backoff between attempts after a lost database or broker: first, factor, ceiling.
BACKOFF = (0.5, 2.0, 10.0)


class Backoff:
    def __init__(self) -> None:
        self.delay = 0.0

    def next(self) -> float:
        first, factor, ceiling = BACKOFF
        self.delay = first if self.delay == 0 else min(self.delay * factor, ceiling)
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


class SignalListener:
    """One listener thread; :meth:`start` it once, :meth:`stop` it on shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = "stopped"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: ListenConnection | None = None
        self._told_to_migrate = False

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reverie-signal-listener", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            # Closing ends the session at once, so a standby takes the lock without
            # waiting for this one's heartbeat.
            conn.close()
        if self._thread is not None:
            self._thread.join(timeout)
        self._set_state("stopped")

    def _set_state(self, state: str, **details: Any) -> None:
        if state == "active" and self._told_to_migrate:
            self.state = state  # said once it wakes signals again (``_woke``), not at each retry
            return
        if state != self.state:
            self.state = state
            log.info("signal listener " + state, **details)

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                self._listen(backoff)
            except DatabaseUnavailable as exc:
                if not self._stop.is_set():
                    self._set_state("disconnected", error=exc.reason)
            except SchemaMissing:
                # A worker started before `reverie migrate` ran: said once, and tried
                # again with backoff (the tables appear when the migration commits).
                if not self._told_to_migrate:
                    log.warning("signal listener waiting: the database has no Reverie tables; run `reverie migrate`")
                    self._told_to_migrate = True
                self.state = "waiting for migrate"
            except Exception as exc:
                # A bug here must not stop the worker: its tasks still run, and the
                # sweeper still wakes what is ready; this thread tries again.
                log.error("signal listener failed", error_type=type(exc).__name__)
                self.state = "failed"
            finally:
                conn, self._conn = self._conn, None
                if conn is not None:
                    conn.close()
            self._stop.wait(backoff.next())

    def _listen(self, backoff: Backoff) -> None:
        conn = self._conn = ListenConnection(self.settings)
        if self._stop.is_set():
            return
        while not conn.take_lead():
            self._set_state("standby")
            backoff.reset()
            if self._stop.wait(self.settings.signal_listener_retry_seconds):
                return
        conn.listen()
        self._set_state("active")
        # Notices sent before LISTEN are lost: catch up on everything ready first.
        todo = Notices(scan=True)
        broker = Backoff()
        while not self._stop.is_set():
            wait = HEARTBEAT_SECONDS
            if todo.scan or todo.ids:
                try:
                    self._wake(todo)
                except BrokerUnavailable as exc:
                    if broker.delay == 0:
                        log.warning("signal listener: broker unavailable", error=exc.reason, sent=exc.sent)
                    # Whatever was not sent is found again by a scan once the broker is back.
                    todo = Notices(scan=True)
                    wait = broker.next()
                else:
                    self._woke(backoff, broker)
                    todo = Notices()
            payloads = conn.receive(wait)
            if payloads:
                todo = _merge(todo, parse(payloads))
            elif not (todo.scan or todo.ids):
                conn.ping()

    def _woke(self, backoff: Backoff, broker: Backoff) -> None:
        """After a wake that worked: the broker is there, and listening and waking work,
        so a failure from here on starts its backoff afresh (one before this point, such
        as a database not migrated yet, keeps growing it)."""
        if broker.delay:
            log.info("signal listener: broker back")
        broker.reset()
        backoff.reset()
        if self._told_to_migrate:
            log.info("signal listener active")
            self._told_to_migrate = False

    def _wake(self, todo: Notices) -> None:
        ids = [signal_id for signal_id, _since in ready(self.settings)] if todo.scan else list(todo.ids)
        for start in range(0, len(ids), BATCH):
            wake_signals(self.settings, ids[start : start + BATCH])


def ready(settings: Settings) -> list[tuple[int, Any]]:
    """The signals a catch-up wakes: every ready one, with no grace (at most a sweep's worth)."""
    return stranded(settings.model_copy(update={"sweep_grace_seconds": 0.0}))


def _merge(first: Notices, second: Notices) -> Notices:
    if first.scan or second.scan:
        return Notices(scan=True)
    return Notices(ids=tuple(sorted({*first.ids, *second.ids})))


def wanted(settings: Settings) -> bool:
    """Whether a worker with these settings listens: PostgreSQL and a broker."""
    return settings.signal_listener and bool(settings.broker_url) and not settings.is_sqlite


_listener: SignalListener | None = None


def _worker_ready(**_: Any) -> None:
    global _listener  # noqa: PLW0603 - one listener per worker main process
    settings = get_settings()
    # Started once the pool has forked its children, so none inherits a running thread.
    if _listener is None and wanted(settings):
        _listener = SignalListener(settings)
        _listener.start()


def _worker_shutdown(**_: Any) -> None:
    global _listener  # noqa: PLW0603 - one listener per worker main process
    if _listener is not None:
        _listener.stop()
        _listener = None


signals.worker_ready.connect(_worker_ready)
signals.worker_shutdown.connect(_worker_shutdown)
