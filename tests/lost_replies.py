"""A commit whose reply is lost: the server has committed, and the connection dies
before the client hears so (a database restarted, a proxy dropping the connection at
that instant). The caller sees the database gone; what it wrote is there."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from worker.errors import DatabaseUnavailable


def lose_the_reply_of(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, *, autocommit: bool = False, after: int = 0
) -> list[Any]:
    """The first call of ``owner.<name>(session, ...)`` (after the first ``after`` calls)
    runs, and the reply to the ``COMMIT`` of its transaction never comes back
    (``autocommit``: its statement has committed on its own, and the reply to the
    statement is what is lost). Returns the list of what those calls returned, appended
    once the reply is lost."""
    lost: list[Any] = []
    called = getattr(owner, name)
    calls = [0]

    def losing(session: Any, *args: Any, **kwargs: Any) -> Any:
        returned = called(session, *args, **kwargs)
        calls[0] += 1
        if calls[0] != after + 1:
            return returned
        raw = session.connection().connection.dbapi_connection
        if autocommit:
            lost.append(returned)
            raw.close()
            raise DatabaseUnavailable("postgresql://db", "server closed the connection unexpectedly")
        commit = raw.commit

        def committed_then_cut() -> None:
            commit()
            lost.append(returned)
            raw.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")

        raw.commit = committed_then_cut
        return returned

    monkeypatch.setattr(owner, name, losing)
    return lost
