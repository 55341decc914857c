"""Reverie's PostgreSQL sessions notice a vanished peer (store.db.SessionGuards).

The multi-host proof, with hosts cut off from the network, is ``tests/test_hosts.py``;
these check the settings themselves on the local server, without root.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from store.db import SessionGuards, dispose_engines, get_engine, session_scope
from worker.errors import DatabaseUnavailable
from worker.settings import Settings

SHOWN = ("idle_in_transaction_session_timeout", "tcp_keepalives_idle", "tcp_keepalives_count", "tcp_user_timeout")


def shown(settings: Settings) -> dict[str, str]:
    with get_engine(settings).connect() as conn:
        return {name: str(conn.execute(text(f"SHOW {name}")).scalar()) for name in SHOWN}


def test_every_session_carries_the_guards_and_zero_leaves_the_servers_own(pg_settings: Settings) -> None:
    guarded = pg_settings.model_copy(
        update={"database_idle_in_transaction_seconds": 45, "database_keepalive_seconds": 6}
    )
    assert shown(guarded) == {
        "idle_in_transaction_session_timeout": "45s",
        "tcp_keepalives_idle": "6",
        "tcp_keepalives_count": "2",
        "tcp_user_timeout": "12000",
    }
    dispose_engines()
    plain = pg_settings.model_copy(update={"database_idle_in_transaction_seconds": 0, "database_keepalive_seconds": 0})
    assert shown(plain)["idle_in_transaction_session_timeout"] == "0"
    assert shown(plain)["tcp_user_timeout"] == "0"


def test_a_transaction_left_idle_is_ended_by_the_server(pg_settings: Settings) -> None:
    settings = pg_settings.model_copy(update={"database_idle_in_transaction_seconds": 1})
    with pytest.raises(DatabaseUnavailable), session_scope(settings) as session:
        session.execute(text("SELECT 1"))
        time.sleep(2.5)  # a host that stopped here, between two statements
        session.execute(text("SELECT 1"))
    # The pool replaces the ended connection: the next transaction works.
    with session_scope(settings) as session:
        assert session.execute(text("SELECT 1")).scalar() == 1


def test_a_setting_the_server_refuses_is_skipped_and_the_others_apply(pg_settings: Settings) -> None:
    class Odd(SessionGuards):
        def server_settings(self) -> dict[str, str]:
            return {"no_such_setting_here": "1", **super().server_settings()}

    engine = get_engine(pg_settings)
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        Odd(idle_in_transaction_seconds=30).apply(raw)
        assert conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "30s"
