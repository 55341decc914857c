"""Engines and sessions, created per process (after fork), never at import.

The task boundary owns the transaction: :func:`session_scope` commits on success and
rolls back on error. Driver errors that mean "the database is not there" become
:class:`~worker.errors.DatabaseUnavailable` here, so callers never see psycopg.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from worker.errors import ConfigError, DatabaseUnavailable, SchemaMissing
from worker.settings import Settings
from worker.url_secrets import mask_secrets, mask_url

_engines: dict[tuple[int, str], Engine] = {}
T = TypeVar("T")

#: ``application_name`` of Reverie's PostgreSQL sessions unless the URL names another.
APPLICATION_NAME = "reverie"


def safe_url(url: str) -> str:
    """The URL with every secret masked (password, ``?password=``...), for messages and logs."""
    try:
        make_url(url)
    except ArgumentError:
        return "<invalid url>"
    return mask_url(url)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the demo read while it writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def build_engine(url: str, **kwargs: Any) -> Engine:
    """A new engine for ``url``; PostgreSQL connections fail fast instead of hanging."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(f"REVERIE_DATABASE_URL is not a database URL: {safe_url(url)}") from exc
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise ConfigError(f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite")
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("connect_timeout", 5)
    # Named, so an operator can find (or terminate) Reverie's sessions in
    # pg_stat_activity; a name given in the URL (``?application_name=``) wins.
    if "application_name" not in parsed.query:
        connect_args.setdefault("application_name", APPLICATION_NAME)
    try:
        return create_engine(url, connect_args=connect_args, **kwargs)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"database driver missing: {exc.name}") from exc


def get_engine(settings: Settings) -> Engine:
    """This process's engine for the settings' URL (a forked child builds its own)."""
    key = (os.getpid(), settings.database_url)
    engine = _engines.get(key)
    if engine is None:
        engine = _engines[key] = build_engine(settings.database_url)
    return engine


def dispose_engines() -> None:
    """Forget every engine of this process (after fork, and in tests)."""
    for (pid, _url), engine in list(_engines.items()):
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


def closing_transaction(
    settings: Settings, work: Callable[[Session], T], *, attempts: int = 5, pause: float = 0.2
) -> T:
    """Run ``work`` in a transaction of its own, again on a fresh connection when the
    connection was lost (:class:`DatabaseUnavailable`), up to ``attempts`` times.

    For the short transactions that close what a task opened (a run's ledger row, a
    lease): one dropped connection must not leave them open until a lease runs out.
    ``work`` must be safe to repeat, since a commit whose reply was lost may have
    happened. Raises the last :class:`DatabaseUnavailable` when every attempt failed.
    """
    for attempt in range(1, attempts + 1):
        try:
            with session_scope(settings) as session:
                return work(session)
        except DatabaseUnavailable:
            if attempt == attempts:
                raise
            # The pool's pre-ping replaces dead connections on the next checkout.
            time.sleep(pause * attempt)
    raise AssertionError("unreachable")


@contextmanager
def translate_errors(settings: Settings) -> Iterator[None]:
    """Turn "cannot connect" driver errors into :class:`DatabaseUnavailable`."""
    try:
        yield
    except OperationalError as exc:
        if exc.connection_invalidated or _is_connect_error(exc):
            raise DatabaseUnavailable(safe_url(settings.database_url), _first_line(exc.orig)) from exc
        if "no such table" in str(exc.orig) or "does not exist" in str(exc.orig):
            raise SchemaMissing(_first_line(exc.orig)) from exc
        raise
    except DBAPIError as exc:
        if "UndefinedTable" in type(exc.orig).__name__:
            raise SchemaMissing(_first_line(exc.orig)) from exc
        raise


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
        )
    )


def _first_line(exc: BaseException | None) -> str:
    # A driver may echo what it was given, connection string included.
    return mask_secrets(str(exc).strip().splitlines()[0]) if exc is not None and str(exc).strip() else "unknown error"


def check_connection(settings: Settings) -> None:
    """Connect once, so commands fail with one clear line before doing any work."""
    with translate_errors(settings), get_engine(settings).connect():
        pass


def has_table(settings: Settings, name: str) -> bool:
    with translate_errors(settings):
        return inspect(get_engine(settings)).has_table(name)
