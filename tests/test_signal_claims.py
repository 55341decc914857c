"""A wake-up's claim on PostgreSQL runs a statement written out in SQL; it must claim and
bury exactly what the statement built from the same parts as every other claim does,
over signals in every state a claim can meet."""

from __future__ import annotations

import random
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import text

from store import signals as signal_store
from store.db import session_scope
from worker.settings import Settings

KINDS = ("activity", "session_end", "feedback")
STATES = ("pending", "pending", "pending", "failed_due", "failed_later", "future", "held", "expired", "done", "worn")


def _seed(settings: Settings, seed: int) -> list[int]:
    """40 signals in random states, each available at its own moment; their ids."""
    rng = random.Random(seed)
    order = rng.sample(range(40), 40)  # available in an order that is not the ids'
    rows = []
    for n in range(40):
        state = rng.choice(STATES)
        status = {"failed_due": "failed", "failed_later": "failed", "future": "pending", "worn": "processing"}.get(
            state, {"held": "processing", "expired": "processing", "done": "done"}.get(state, "pending")
        )
        minutes = {"failed_later": 30, "future": 10}.get(state, -100 + order[n])
        lease = {"held": 10, "expired": -1, "worn": -1}.get(state)
        attempts = 5 if state == "worn" or rng.random() < 0.1 else rng.randint(0, 4)
        rows.append((rng.choice(KINDS), f"u{n}", status, minutes, lease, attempts))
    with session_scope(settings) as session:
        session.execute(text("TRUNCATE dream_signals RESTART IDENTITY CASCADE"))
        for kind, user, status, minutes, lease, attempts in rows:
            session.execute(
                text(
                    "INSERT INTO dream_signals (kind, user_id, payload, status, attempts, available_at, claimed_until) "
                    "VALUES (:kind, :user, '{}', :status, :attempts, "
                    "timezone('utc', now()) + make_interval(mins => :minutes), "
                    "CASE WHEN CAST(:lease AS int) IS NULL THEN NULL "
                    "ELSE timezone('utc', now()) + make_interval(mins => CAST(:lease AS int)) END)"
                ),
                {
                    "kind": kind,
                    "user": user,
                    "status": status,
                    "attempts": attempts,
                    "minutes": minutes,
                    "lease": lease,
                },
            )
    return list(range(1, 41))


def _claim(settings: Settings, signal_id: int, kinds: tuple[str, ...], limit: int) -> dict[str, Any]:
    buried: list[tuple[int, str]] = []
    with session_scope(settings) as session:
        claimed = signal_store.claim_signals(
            session,
            lease_seconds=300,
            limit=limit,
            signal_id=signal_id,
            also_kinds=kinds,
            max_attempts=5,
            with_payload=True,
            bury_own=True,
            buried_rows=buried,
        )
    with session_scope(settings) as session:
        state = session.execute(
            text(
                "SELECT id, status, attempts, last_error, claim_token IS NOT NULL, "
                "round(extract(epoch FROM claimed_until - timezone('utc', now())) / 60) "
                "FROM dream_signals ORDER BY id"
            )
        ).all()
    return {
        "claimed": [(c.signal_id, c.kind, c.user_id, c.attempts, c.payload_text) for c in claimed],
        "buried": sorted(buried),
        "rows": [tuple(r) for r in state],
    }


def _wake_up(seed: int) -> tuple[int, tuple[str, ...], int]:
    """A wake-up of scenario ``seed``: its own signal, the kinds it fills with, its limit."""
    rng = random.Random(1000 + seed)
    return rng.randint(1, 40), tuple(rng.sample(KINDS, rng.randint(1, 3))), rng.choice([1, 2, 5, 20])


@pytest.mark.parametrize("seed", range(12))
def test_the_written_out_claim_does_what_the_built_one_does(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    own, kinds, limit = _wake_up(seed)
    _seed(pg_settings, seed)
    written = _claim(pg_settings, own, kinds, limit)
    monkeypatch.setattr(signal_store, "PREBUILT_WAKEUP_CLAIM", False)
    _seed(pg_settings, seed)
    built = _claim(pg_settings, own, kinds, limit)
    assert written == built


def test_the_scenarios_meet_every_outcome(pg_settings: Settings) -> None:
    # The comparison above is worth something only if its claims take, fill and bury.
    seen = {"own": False, "fill": False, "buried": False, "nothing": False}
    for seed in range(12):
        own, kinds, limit = _wake_up(seed)
        _seed(pg_settings, seed)
        result = _claim(pg_settings, own, kinds, limit)
        ids = [c[0] for c in result["claimed"]]
        seen["own"] |= own in ids
        seen["fill"] |= any(i != own for i in ids)
        seen["buried"] |= bool(result["buried"])
        seen["nothing"] |= not ids
    assert all(seen.values()), seen


def test_a_batch_is_finished_only_where_its_claims_still_hold(store_settings: Settings) -> None:
    with session_scope(store_settings) as session:
        for n in range(4):
            session.execute(
                text("INSERT INTO dream_signals (kind, user_id, payload) VALUES ('activity', :user, '{}')"),
                {"user": f"u{n}"},
            )
    with session_scope(store_settings) as session:
        claimed = signal_store.claim_signals(session, lease_seconds=300, limit=4)
    assert len(claimed) == 4
    pairs = [(c.signal_id, c.claim_token) for c in claimed]
    pairs[1] = (pairs[1][0], "another worker's token")  # taken over since
    with session_scope(store_settings) as session:
        session.execute(text("UPDATE dream_signals SET status = 'pending' WHERE id = :id"), {"id": pairs[2][0]})
    with session_scope(store_settings) as session:
        held, at = signal_store.finish_signals(session, pairs, status="done")
    assert held == {pairs[0][0], pairs[3][0]}
    with session_scope(store_settings) as session:
        rows = session.execute(
            text("SELECT id, status, claim_token IS NULL, processed_at FROM dream_signals ORDER BY id")
        ).all()
    assert [(r[1], r[2]) for r in rows] == [("done", True), ("processing", False), ("pending", False), ("done", True)]
    # One time for the batch, the one returned (SQLite's raw rows hold it as text).
    assert {datetime.fromisoformat(str(rows[i][3])) for i in (0, 3)} == {at}
