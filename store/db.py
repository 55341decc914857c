"""Engines and sessions, created per process (after fork), never at import.

The task boundary owns the transaction: :func:`session_scope` commits on success and
rolls back on error. Driver errors that mean "the database is not there" become
:class:`~worker.errors.DatabaseUnavailable` here, so callers never see psycopg.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from worker.errors import ConfigError, DatabaseUnavailable, MemoryTableMissing, SchemaMissing, StoredValueUnreadable
from worker.logs import get_logger
from worker.settings import Settings
from worker.url_secrets import mask_secrets, mask_url

log = get_logger(__name__)

#: This process's engines, by (process, URL, for reads on their own: see :func:`get_read_engine`).
_engines: dict[tuple[int, str, bool], Engine] = {}
T = TypeVar("T")

#: ``application_name`` of Reverie's PostgreSQL sessions unless the URL names another.
APPLICATION_NAME = "reverie"


def safe_url(url: str) -> str:
    """The URL with every secret masked (password, ``?password=``...), for messages and
    logs; PostgreSQL's as the operator wrote it (``postgresql://``, not the driver's
    ``postgresql+psycopg://`` the settings make of it)."""
    try:
        make_url(url)
    except (ArgumentError, ValueError):
        return "<invalid url>"
    shown = mask_url(url)
    driver = "postgresql+psycopg://"
    return "postgresql://" + shown.removeprefix(driver) if shown.startswith(driver) else shown


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the demo read while it writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
    # SQLite has no hash function: the fingerprints of profiles need one (see
    # ``store.profiles.content_hash``).
    dbapi_connection.create_function(SQLITE_HASH, -1, sqlite_hash, deterministic=True)
    # SQLite's own lower() folds ASCII letters only: Python's, as PostgreSQL's does them all.
    dbapi_connection.create_function(SQLITE_LOWER, 1, sqlite_lower, deterministic=True)


def hold_writes(session: Session) -> None:
    """From now until the session's transaction ends, no other connection writes: on
    SQLite, take the database's write lock at once (a write that changes nothing), so
    the rows read next cannot change before this transaction writes after them (SQLite
    has no ``FOR UPDATE``, and Python's driver opens no transaction for a ``SELECT``).
    PostgreSQL: nothing (lock the rows read with ``FOR UPDATE``)."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(text("DELETE FROM dream_user_state WHERE 0"))


#: The hash function every SQLite connection of Reverie's has (any number of arguments).
SQLITE_HASH = "reverie_hash"


#: Every SQLite connection of Reverie's has this ``lower`` of any letter (see :func:`sqlite_lower`).
SQLITE_LOWER = "reverie_lower"


def sqlite_lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def sqlite_hash(*parts: Any) -> int:
    """A hash of the values' text joined by ``\x1f`` (NULL as the empty text), a signed
    32-bit number: SQLite's stand-in for PostgreSQL's ``hashtext``."""
    joined = "\x1f".join("" if part is None else str(part) for part in parts)
    return zlib.crc32(joined.encode("utf-8", "surrogatepass")) - 2**31


@dataclass(frozen=True)
class SessionGuards:
    """How both ends of a PostgreSQL connection notice that the other has vanished.

    A host cut off from the network says nothing: without these, the server keeps its
    session (and every row lock its open transaction holds: a dream lease, a signal)
    until TCP gives up, two hours later by default, and the host itself waits up to
    fifteen minutes on a reply that cannot come. The server ends a session whose
    transaction has been idle ``idle_in_transaction_seconds`` (Reverie never waits
    inside a transaction: model calls happen between them), and each side probes a
    silent connection after ``keepalive_seconds`` and drops it two probes later.
    Zero leaves the server's (or the operating system's) setting.
    """

    idle_in_transaction_seconds: float = 0.0
    keepalive_seconds: float = 0.0

    @classmethod
    def of(cls, settings: Settings) -> SessionGuards:
        return cls(settings.database_idle_in_transaction_seconds, settings.database_keepalive_seconds)

    def _probes(self) -> tuple[int, int, int]:
        idle = max(1, round(self.keepalive_seconds))
        interval = max(1, round(self.keepalive_seconds / 2))
        # Unacknowledged data counts the same: a reply that cannot arrive ends the wait.
        return idle, interval, (idle + 2 * interval) * 1000

    def client_args(self) -> dict[str, Any]:
        """libpq connection parameters for this side (the Reverie host)."""
        if not self.keepalive_seconds:
            return {}
        idle, interval, user_timeout = self._probes()
        return {
            "keepalives": 1,
            "keepalives_idle": idle,
            "keepalives_interval": interval,
            "keepalives_count": 2,
            "tcp_user_timeout": user_timeout,
        }

    def server_settings(self) -> dict[str, str]:
        """Session settings for the server's side of the connection."""
        values: dict[str, str] = {}
        if self.idle_in_transaction_seconds:
            values["idle_in_transaction_session_timeout"] = str(max(1, round(self.idle_in_transaction_seconds * 1000)))
        if self.keepalive_seconds:
            idle, interval, user_timeout = self._probes()
            values |= {
                "tcp_keepalives_idle": str(idle),
                "tcp_keepalives_interval": str(interval),
                "tcp_keepalives_count": "2",
                "tcp_user_timeout": str(user_timeout),
            }
        return values

    def apply(self, dbapi_connection: Any) -> None:
        """Set :meth:`server_settings` on a new connection (:func:`apply_session_settings`)."""
        apply_session_settings(dbapi_connection, self.server_settings())


#: Every Reverie session's time zone. Reverie's times are naive UTC; a host's column
#: with a time zone (a last-access column) is compared with them, and PostgreSQL reads
#: a naive time in the session's zone: in UTC, a cutoff, a ranking's day and a
#: comparison mean the same whatever zone the server was set up in.
SESSION_TIME_ZONE = "UTC"


def apply_session_settings(dbapi_connection: Any, values: dict[str, str]) -> None:
    """Set ``values`` on a new connection (as a ``SET`` would, so it works behind a
    pooler in session mode; PgBouncer carries ``TimeZone`` in any mode), in one round
    trip, and leave no transaction open. A setting the server refuses (an old version,
    a system without the option) is skipped with a warning; the others still apply.
    A connection lost meanwhile (killed, the server restarting) fails the connect with
    the driver's error, which reads as the database gone and is tried again."""
    if not values:
        return
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    with dbapi_connection.cursor() as cursor:
        try:
            cursor.execute("SELECT " + ", ".join(["set_config(%s, %s, false)"] * len(values)), _flat(values))
        except psycopg.Error as exc:
            _raise_if_lost(dbapi_connection, exc)
            # One was refused: each on its own, to keep the others.
            for name, value in values.items():
                try:
                    cursor.execute("SELECT set_config(%s, %s, false)", (name, value))
                except psycopg.Error as refused:
                    _raise_if_lost(dbapi_connection, refused)
                    log.warning("database_setting_refused", setting=name, error_type=type(refused).__name__)
    dbapi_connection.autocommit = autocommit


def _flat(values: dict[str, str]) -> list[str]:
    return [part for pair in values.items() for part in pair]


def _raise_if_lost(dbapi_connection: Any, exc: psycopg.Error) -> None:
    """Raise, as a lost connection, ``exc`` from a connection that is gone (closed, or
    broken by a lost server): whatever the driver's words (a timeout, a reset, an SSL
    EOF), the connect then reads as the database gone (:func:`translate_errors`)."""
    if dbapi_connection.closed or getattr(dbapi_connection, "broken", False):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise psycopg.OperationalError(f"{LOST_CONNECTION}: {reason}") from exc


#: How a connection lost while it was being set up is reported (one of the phrases
#: :func:`translate_errors` reads as the database gone).
LOST_CONNECTION = "the connection is lost"


def read_json(raw: str | bytes) -> Any:
    """A JSON column's value as the database hands it out: what is not JSON (SQLite
    never checks its ``JSON`` columns) or is nested deeper than Python reads (``jsonb``
    holds that too) is refused in words that name neither the value nor its user,
    instead of a bare decoder error."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise StoredValueUnreadable("is nested deeper than Reverie reads (about 1,000 levels)") from None
    except ValueError:
        raise StoredValueUnreadable(
            "is not valid JSON",
            " (on SQLite, `SELECT id, user_id, key FROM usermemories WHERE NOT json_valid(value)`"
            " finds such rows; the memory table may have another name: REVERIE_MEMORY_TABLE)",
        ) from None


def build_engine(url: str, *, guards: SessionGuards | None = None, **kwargs: Any) -> Engine:
    """A new engine for ``url``; PostgreSQL connections fail fast instead of hanging,
    and with ``guards`` notice a vanished peer (see :class:`SessionGuards`)."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"REVERIE_DATABASE_URL is not a database URL: {safe_url(url)}") from exc
    except ValueError as exc:
        raise ConfigError("REVERIE_DATABASE_URL is not a database URL: its port is not a number") from exc
    # A statement's parameters (memory values, user ids) stay out of its errors' text,
    # which may be logged or kept.
    kwargs.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("json_deserializer", read_json)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise ConfigError(f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite")
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    kwargs.setdefault("json_deserializer", read_json)
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("connect_timeout", 5)
    # Named, so an operator can find (or terminate) Reverie's sessions in
    # pg_stat_activity; a name given in the URL (``?application_name=``) wins.
    if "application_name" not in parsed.query:
        connect_args.setdefault("application_name", APPLICATION_NAME)
    if guards is not None:
        for name, value in guards.client_args().items():
            if name not in parsed.query:
                connect_args.setdefault(name, value)
    try:
        engine = create_engine(url, connect_args=connect_args, **kwargs)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"database driver missing: {exc.name}") from exc
    values = {"TimeZone": SESSION_TIME_ZONE, **(guards.server_settings() if guards is not None else {})}
    event.listen(engine, "connect", lambda dbapi_connection, _record: apply_session_settings(dbapi_connection, values))
    return engine


def get_engine(settings: Settings) -> Engine:
    """This process's engine for the settings' URL (a forked child builds its own). Its
    pool checks each connection it hands out with an empty query first (pre-ping), so
    a connection the server dropped is replaced before any work is begun on it."""
    return _engine(settings, reads=False)


def get_read_engine(settings: Settings) -> Engine:
    """The engine of reads on their own (:func:`read_once`), on PostgreSQL a pool of its
    own that hands out connections without that check: on a prompt's path the check is
    a round trip of its own (about a third of a profile read's time), and a read can
    simply be made again on a new connection where the pooled one turns out dropped."""
    return _engine(settings, reads=True)


def _engine(settings: Settings, *, reads: bool) -> Engine:
    key = (os.getpid(), settings.database_url, reads)
    engine = _engines.get(key)
    if engine is None:
        if reads and get_engine(settings).dialect.name != "postgresql":
            engine = _engines[key] = get_engine(settings)  # SQLite: one engine for all
            return engine
        options = {"pool_pre_ping": False} if reads else {}
        engine = _engines[key] = build_engine(settings.database_url, guards=SessionGuards.of(settings), **options)
    return engine


def dispose_engines() -> None:
    """Forget every engine of this process (after fork, and in tests)."""
    for (pid, _url, _reads), engine in list(_engines.items()):
        if pid == os.getpid():
            engine.dispose()
        else:
            # Inherited from the parent: drop the pool without closing its sockets.
            engine.dispose(close=False)
    _engines.clear()


def session_factory(settings: Settings) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(settings: Settings) -> Iterator[Session]:
    """A session whose transaction commits when the block ends and rolls back on error."""
    session = session_factory(settings)()
    try:
        with translate_errors(settings):
            yield session
            session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@contextmanager
def committing(settings: Settings, on_lost_reply: Callable[[Session], object]) -> Iterator[Session]:
    """:func:`session_scope` for a transaction that takes something others wait for (a
    lease). Where its ``COMMIT`` fails with the connection lost, it may have committed
    all the same (the reply is what was lost): ``on_lost_reply`` then gives back what it
    took, in a :func:`closing_transaction`, before the error is raised. It must match
    only what this transaction took (a token of its own), so that where nothing
    committed it does nothing. A failure before the ``COMMIT`` committed nothing and is
    raised as it is."""
    body_done = False
    try:
        with session_scope(settings) as session:
            yield session
            body_done = True
    except DatabaseUnavailable:
        if body_done:
            give_back(settings, on_lost_reply)
        raise


def give_back(settings: Settings, work: Callable[[Session], object], *, within: float = 30.0) -> None:
    """Give back, in a :func:`closing_transaction`, what a transaction whose reply was
    lost may have taken (see :func:`committing`); where that fails (the database stays
    gone), what it took runs out by itself (a lease's length), and this says so in a
    warning. It never raises: the caller raises the error it follows, which is the one
    its task is retried on."""
    try:
        closing_transaction(settings, work, within=within)
    except Exception as exc:
        log.warning("database_gone_at_commit", given_back=False, error_type=type(exc).__name__)


def read_once(settings: Settings, read: Callable[[Connection], T]) -> T:
    """Run ``read`` (statements that only read, and are safe to make again) on a
    connection outside any transaction (autocommit): each statement sees the database
    as of its start, and no ``BEGIN`` or ``COMMIT`` makes a round trip. For one-statement
    reads, such as a profile read on a prompt's path, where making an ORM session would
    cost about as much as the round trip. The connection comes from
    :func:`get_read_engine`'s pool, unchecked: where the server had dropped it (a
    restart, an idle timeout), ``read`` runs once more on a new connection."""
    engine = get_read_engine(settings)
    with translate_errors(settings):
        try:
            return _autocommit(engine, read)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        # The pool let go of every connection made before the lost one: this one is new.
        return _autocommit(engine, read)


def _autocommit(engine: Engine, read: Callable[[Connection], T]) -> T:
    with engine.connect() as connection:
        return read(connection.execution_options(isolation_level="AUTOCOMMIT"))


@contextmanager
def driver_cursor(session: Session) -> Iterator[Any]:
    """A cursor of the session's own driver connection (in its transaction), for what the
    driver does much faster than a statement through SQLAlchemy: ``COPY``, rows read as
    plain tuples. Its errors come out as SQLAlchemy's do, and a connection it lost is
    invalidated, as for any other statement, so :func:`translate_errors` and the pool
    see them the same way."""
    connection = session.connection()
    raw: Any = connection.connection.dbapi_connection
    assert raw is not None
    dialect = connection.dialect
    try:
        with raw.cursor() as cursor:
            yield cursor
    except dialect.loaded_dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, raw, None)
        if lost:
            connection.invalidate(exc)
        raise DBAPIError.instance(
            None, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
        ) from exc


def closing_transaction(
    settings: Settings,
    work: Callable[[Session], T],
    *,
    within: float = 30.0,
    pause: float = 0.2,
    attempts: int | None = None,
) -> T:
    """Run ``work`` in a transaction of its own, again on a fresh connection when the
    connection was lost (:class:`DatabaseUnavailable`), for up to ``within`` seconds
    (and at most ``attempts`` times, when given), waiting a little longer each time.

    For the short transactions that close what a task opened (a run's ledger row, a
    lease): a database that drops connections for a while must not leave them open
    until a lease runs out, which is many minutes. ``work`` must be safe to repeat,
    since a commit whose reply was lost may have happened. Raises the last
    :class:`DatabaseUnavailable` when the time (or the attempts) ran out.
    """
    began = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            with session_scope(settings) as session:
                return work(session)
        except DatabaseUnavailable:
            wait = min(pause * attempt, 2.0)
            if (attempts is not None and attempt >= attempts) or time.monotonic() - began + wait > within:
                raise
            # The pool's pre-ping replaces dead connections on the next checkout.
            time.sleep(wait)


#: The server ended the session (the driver reports these as internal errors, not as a
#: lost connection): the work is rolled back and may be tried again on a new one.
_ENDED_BY_SERVER = ("IdleInTransactionSessionTimeout", "IdleSessionTimeout")


def lost_connection(exc: BaseException) -> bool:
    """Whether ``exc`` is the database connection lost or ended by the server (work to try
    again on a new one), as SQLAlchemy or the driver raised it. SQLAlchemy's error says
    whether the connection broke (it looks at the connection itself); the driver's own
    (from a raw cursor) only by its SQLSTATE, and only for the server ending the session
    (57P01-57P03: an administrator's ``pg_terminate_backend``, a shutdown, a restart). Not
    by class 08 alone: dblink and postgres_fdw raise it on a healthy session for a remote
    server they cannot reach, and that is the signal's error, not the connection's."""
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or type(exc.orig).__name__ in _ENDED_BY_SERVER
    if isinstance(exc, psycopg.Error):
        return type(exc).__name__ in _ENDED_BY_SERVER or str(exc.sqlstate or "") in _SESSION_ENDED
    return False


#: SQLSTATEs of the server ending the session: admin_shutdown, crash_shutdown, cannot_connect_now.
_SESSION_ENDED = ("57P01", "57P02", "57P03")

#: SQLSTATEs of a transaction the server rolled back so that another could go on:
#: deadlock_detected, serialization_failure. Tried again, it finds the other finished.
_ROLLED_BACK_FOR_ANOTHER = ("40P01", "40001")
#: How many times a transaction is run in all when the server keeps choosing it so.
CONFLICT_ATTEMPTS = 4


def rolled_back_for_another(exc: BaseException) -> bool:
    """Whether the server rolled the transaction back as a deadlock's victim (or for a
    serialization failure): nothing of it was written, and it may be run again."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    return str(getattr(orig, "sqlstate", None) or "") in _ROLLED_BACK_FOR_ANOTHER


def retrying_conflicts(work: Callable[[], T], *, attempts: int = CONFLICT_ATTEMPTS) -> T:
    """Run ``work``, one whole transaction, again (after a short, growing pause) when the
    server chose it as a deadlock's victim, up to ``attempts`` times in all. Lock orders
    are kept the same everywhere Reverie can see both sides; this is for the orders it
    cannot (an application's own transactions, or a plan's row order)."""
    attempt = 1
    while True:
        try:
            return work()
        except DBAPIError as exc:
            if attempt >= attempts or not rolled_back_for_another(exc):
                raise
            log.info("transaction_retried", reason=type(exc.orig).__name__, attempt=attempt)
        time.sleep(0.05 * attempt)
        attempt += 1


@contextmanager
def translate_errors(settings: Settings) -> Iterator[None]:
    """Turn "cannot connect" driver errors into :class:`DatabaseUnavailable`."""
    try:
        yield
    except OperationalError as exc:
        if exc.connection_invalidated or _is_connect_error(exc):
            raise DatabaseUnavailable(safe_url(settings.database_url), _first_line(exc.orig)) from exc
        if "no such table" in str(exc.orig) or "does not exist" in str(exc.orig):
            raise _missing(settings, exc) from exc
        raise
    except DBAPIError as exc:
        if lost_connection(exc):
            raise DatabaseUnavailable(safe_url(settings.database_url), _first_line(exc.orig)) from exc
        if "UndefinedTable" in type(exc.orig).__name__:
            raise _missing(settings, exc) from exc
        raise


def _missing(settings: Settings, exc: DBAPIError) -> SchemaMissing:
    """The schema is missing; or, where the missing table is the memory table in a
    migrated database, the setting names another table (migrate would make a new, empty
    one: not the advice to give)."""
    detail = _first_line(exc.orig)
    name = settings.memory_table
    # PostgreSQL: relation "NAME" does not exist; SQLite: no such table: NAME.
    if (f'"{name}"' in detail or detail.endswith(f"table: {name}")) and _migrated(settings):
        return MemoryTableMissing(name)
    return SchemaMissing(detail)


def _migrated(settings: Settings) -> bool:
    from store.migrate import VERSION_TABLE

    try:
        return has_table(settings, VERSION_TABLE)
    except (DatabaseUnavailable, DBAPIError):  # only the message depends on it
        return False


def _is_connect_error(exc: OperationalError) -> bool:
    text = str(exc.orig).lower()
    return any(
        marker in text
        for marker in (
            "connection refused",
            "could not connect",
            "connection failed",
            "timeout expired",
            "unable to open database file",
            "no route to host",
            "name or service not known",
            "password authentication failed",
            'database "',
            "server closed the connection",
            "terminating connection",
            # psycopg's word for a connection that broke before the statement was
            # sent, and how one lost while it was being set up is reported.
            LOST_CONNECTION,
        )
    )


def _first_line(exc: BaseException | None) -> str:
    # A driver may echo what it was given, connection string included.
    return mask_secrets(str(exc).strip().splitlines()[0]) if exc is not None and str(exc).strip() else "unknown error"


#: The oldest PostgreSQL served (``server_version_num``): 14 has ``hash_record``, which
#: the profiles' fingerprint hashes rows with.
MIN_POSTGRESQL = 140000


def check_connection(settings: Settings) -> None:
    """Connect once, so commands fail with one clear line before doing any work; a
    PostgreSQL older than :data:`MIN_POSTGRESQL` is refused (:class:`ConfigError`)."""
    with translate_errors(settings), get_engine(settings).connect() as connection:
        if settings.is_sqlite:
            return
        number = int(connection.exec_driver_sql("SHOW server_version_num").scalar() or 0)
    if number < MIN_POSTGRESQL:
        raise ConfigError(f"PostgreSQL {MIN_POSTGRESQL // 10000} or newer is needed; this server is {number // 10000}")


def has_table(settings: Settings, name: str) -> bool:
    with translate_errors(settings):
        return inspect(get_engine(settings)).has_table(name)
