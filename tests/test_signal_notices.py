"""PostgreSQL's notice of new signals (the trigger on ``dream_signals``): sent on commit,
one per statement however many rows, ids or a scan marker, none for a duplicate, and
none for the rows of a producer that sends its own wake-up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from store.db import session_scope
from store.notices import CHANNEL, MARKER_SCAN, MAX_PAYLOAD_BYTES, ListenConnection, parse, producer_wakes
from worker import wakeup
from worker.producer import enqueue_signal
from worker.settings import Settings

PAYLOAD = {"events": [{"action": "digest", "at": "2025-01-06T09:00:00"}]}


@pytest.fixture()
def listening(pg_settings: Settings) -> Iterator[ListenConnection]:
    conn = ListenConnection(pg_settings)
    conn.listen()
    yield conn
    conn.close()


@pytest.fixture()
def producer(pg_settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(pg_settings.database_url.replace("+psycopg", ""), autocommit=True)
    yield conn
    conn.close()


def _insert_many(conn: psycopg.Connection[Any], prefix: str, count: int) -> list[int]:
    rows = conn.execute(
        "INSERT INTO dream_signals (kind, user_id, payload) "
        "SELECT 'activity', %s || g, '{}'::jsonb FROM generate_series(1, %s) g RETURNING id",
        (prefix, count),
    ).fetchall()
    return sorted(row[0] for row in rows)


def test_a_plain_insert_notifies_its_id_on_commit_and_not_before(
    listening: ListenConnection, producer: psycopg.Connection[Any]
) -> None:
    with producer.transaction():
        signal_id = producer.execute(
            "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u1', %s) RETURNING id",
            (json.dumps(PAYLOAD),),
        ).fetchone()
        assert listening.receive(0.3) == []

    assert signal_id is not None
    assert listening.receive(5.0) == [str(signal_id[0])]


def test_a_bulk_insert_of_500_rows_is_one_notice_with_every_id(
    listening: ListenConnection, producer: psycopg.Connection[Any]
) -> None:
    ids = _insert_many(producer, "bulk-", 500)

    payloads = listening.receive(5.0) + listening.receive(0.5)

    assert len(payloads) == 1
    assert parse(payloads).ids == tuple(ids)


def test_ids_that_do_not_fit_in_a_notice_become_the_scan_marker(
    listening: ListenConnection, producer: psycopg.Connection[Any]
) -> None:
    ids = _insert_many(producer, "huge-", 3000)
    assert len(",".join(map(str, ids))) > MAX_PAYLOAD_BYTES

    payloads = listening.receive(5.0) + listening.receive(0.5)

    assert payloads == [MARKER_SCAN]
    assert parse(payloads).scan


def test_a_duplicate_with_on_conflict_do_nothing_neither_aborts_nor_notifies(
    listening: ListenConnection, producer: psycopg.Connection[Any]
) -> None:
    insert = "INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'u2', %s) ON CONFLICT DO NOTHING"
    with producer.transaction():
        producer.execute(insert, (json.dumps(PAYLOAD),))
    assert len(listening.receive(5.0)) == 1

    with producer.transaction():
        producer.execute(insert, (json.dumps(PAYLOAD),))
        # The producer's transaction goes on after the duplicate.
        assert producer.execute("SELECT count(*) FROM dream_signals").fetchone() == (1,)

    assert listening.receive(0.5) == []


def test_the_helper_that_wakes_the_worker_itself_sends_no_notice_and_leaves_later_inserts_notified(
    pg_settings: Settings, listening: ListenConnection, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeup, "_quiet_until", 0.0)
    settings = pg_settings.model_copy(update={"broker_url": redis_url})
    with session_scope(settings) as session:
        enqueue_signal("activity", "helper", PAYLOAD, session=session, settings=settings)
        later = session.execute(
            text("INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', 'raw', '{}') RETURNING id")
        ).scalar_one()

    assert listening.receive(5.0) == [str(later)]
    assert listening.receive(0.5) == []


def test_the_helper_without_a_broker_leaves_the_notice_to_reach_a_worker(
    pg_settings: Settings, listening: ListenConnection
) -> None:
    result = enqueue_signal("activity", "cron-producer", PAYLOAD, settings=pg_settings)

    assert listening.receive(5.0) == [str(result.signal_id)]


def test_the_listening_connection_hears_the_trigger_channel(pg_settings: Settings) -> None:
    # The migration spells the channel out; both sides must name the same one.
    with psycopg.connect(pg_settings.database_url.replace("+psycopg", "")) as conn:
        source = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'dream_signals_notify'").fetchone()
    assert source is not None
    assert f"pg_notify('{CHANNEL}', ids)" in source[0]
    assert f"> {MAX_PAYLOAD_BYTES}" in source[0]


def test_a_failing_insert_under_the_producers_setting_raises_its_own_error(pg_settings: Settings) -> None:
    with pytest.raises(DBAPIError) as info, session_scope(pg_settings) as session, producer_wakes(session):
        session.execute(text("INSERT INTO dream_signals (kind, user_id, payload) VALUES (NULL, 'u', '{}')"))

    assert isinstance(info.value.orig, psycopg.errors.NotNullViolation)
