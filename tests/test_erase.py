"""reverie erase-user: no table holds a row about the user afterwards (real PostgreSQL)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from store import signals as signal_store
from store.db import session_scope
from store.erase import rows_about
from store.memories import remove_entries, table_for
from store.models import Run, Signal, Spend
from tasks import session_end
from tasks.activity import detect_routines
from tasks.erase import erase_user
from tasks.signals import HANDLERS, Handler, process_claimed, process_pending
from worker.cli import app
from worker.producer import enqueue_signal
from worker.settings import Settings, get_settings


def said(text: str, conversation: str = "c1") -> dict[str, Any]:
    return {"conversation_id": conversation, "agent_id": "a", "messages": [{"role": "user", "content": text}]}


LONG = "Thanks for asking. " + "The report covers revenue, costs and the outlook for every region we track. " * 3


def populate(settings: Settings, user: str) -> None:
    enqueue_signal("session_end", user, said("My favorite color is blue"), settings=settings)
    enqueue_signal("session_end", user, said("My favorite color is red", "c2"), settings=settings)
    enqueue_signal("feedback", user, {"deliverable_id": "d", "original": LONG, "edited": "Short."}, settings=settings)
    enqueue_signal("activity", user, {"events": [{"action": "x", "at": "2024-05-06T09:00:00Z"}]}, settings=settings)
    process_pending(settings)
    detect_routines(settings)
    table = table_for(settings)
    with session_scope(settings) as session:
        run = Run(user_id=user)
        session.add(run)
        session.flush()
        session.add(Spend(scope="run", scope_key=f"{run.id}/abc", limit_nano=10))
        remove_entries(session, table, table.c.user_id == user, reason="prune", source="prune", run_id=run.id)
        session.execute(table.insert().values(id=f"{user}-left", user_id=user, key="k", value="v"))


def test_no_table_holds_a_row_about_the_user(pg_settings: Settings) -> None:
    populate(pg_settings, "ann")
    populate(pg_settings, "ben")
    with session_scope(pg_settings) as session:
        before = rows_about(session, pg_settings, "ann")
    assert sum(before.values()) > 10
    with session_scope(pg_settings) as session:
        signal_lines = {
            user: set(
                session.scalars(
                    select(Spend.scope_key).where(
                        Spend.scope == "signal",
                        Spend.scope_key.in_(
                            [str(i) for i in session.scalars(select(Signal.id).where(Signal.user_id == user))]
                        ),
                    )
                )
            )
            for user in ("ann", "ben")
        }
    assert signal_lines["ann"] and signal_lines["ben"]  # each signal's own budget line
    counts = erase_user(pg_settings, "ann")
    # Her run's budget, her signals' budget for the day, and each of her signals' own.
    assert counts["dream_spend"] == 2 + len(signal_lines["ann"])
    with session_scope(pg_settings) as session:
        assert set(rows_about(session, pg_settings, "ann").values()) == {0}
        assert rows_about(session, pg_settings, "ben") == {k: v for k, v in before.items()}
        left = set(session.scalars(select(Spend.scope_key).where(Spend.scope == "signal")))
    assert left == signal_lines["ben"]


@pytest.mark.parametrize("path", ["chunk", "one user"])
def test_a_dream_queued_before_the_erasure_does_not_bring_the_user_back(store_settings: Settings, path: str) -> None:
    """The dispatcher sent ann's (and ben's) dream; ann is erased before a worker takes
    the message. The run that comes of it makes nothing of ann's (no schedule, no
    ledger row, no profile): every table is still clear of her, and ben is dreamed."""
    from store.models import UserState
    from tasks.dream import UNKNOWN_USER, dream_user, dream_users

    populate(store_settings, "ann")
    populate(store_settings, "ben")
    erase_user(store_settings, "ann")
    if path == "chunk":
        outcomes = {o.user_id: o for o in dream_users(store_settings, ["ann", "ben"])}
    else:
        outcomes = {u: dream_user(store_settings, u, trigger="schedule") for u in ("ann", "ben")}
    assert (outcomes["ann"].status, outcomes["ann"].error, outcomes["ann"].run_id) == ("skipped", UNKNOWN_USER, None)
    assert outcomes["ben"].status == "succeeded"
    with session_scope(store_settings) as session:
        assert set(rows_about(session, store_settings, "ann").values()) == {0}
        assert session.scalar(select(UserState.user_id).where(UserState.user_id == "ben")) == "ben"
    # A user the application writes to again is known again, and dreamed.
    table = table_for(store_settings)
    with session_scope(store_settings) as session:
        session.execute(table.insert().values(id="ann-new", user_id="ann", key="city", value="Oslo"))
    assert dream_user(store_settings, "ann").status == "succeeded"


def test_signals_after_the_erasure_are_processed(pg_settings: Settings) -> None:
    enqueue_signal("session_end", "ann", said("My favorite color is blue"), settings=pg_settings)
    erase_user(pg_settings, "ann")
    enqueue_signal("session_end", "ann", said("My favorite color is green", "c9"), settings=pg_settings)
    assert process_pending(pg_settings).processed == 1
    table = table_for(pg_settings)
    with session_scope(pg_settings) as session:
        assert [r.value for r in session.execute(select(table))] == ["green"]


def test_signal_claimed_before_the_erasure_writes_nothing(pg_settings: Settings) -> None:
    enqueue_signal("session_end", "ann", said("My favorite color is blue"), settings=pg_settings)
    with session_scope(pg_settings) as session:
        [claim] = signal_store.claim_signals(session, lease_seconds=60, limit=1)
    erase_user(pg_settings, "ann")
    assert process_claimed(pg_settings, claim).outcome == "skipped"
    with session_scope(pg_settings) as session:
        assert set(rows_about(session, pg_settings, "ann").values()) == {0}


def test_erasure_waits_for_an_apply_in_flight_and_removes_its_writes(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    applying, release = threading.Event(), threading.Event()

    def slow_apply(session: Any, settings: Settings, signal: Any, prepared: Any) -> Any:
        effect = session_end.apply(session, settings, signal, prepared)
        applying.set()
        release.wait(10)
        return effect

    monkeypatch.setitem(HANDLERS, "session_end", Handler(session_end.prepare, slow_apply))
    enqueue_signal("session_end", "ann", said("My favorite color is blue"), settings=pg_settings)
    worker = threading.Thread(target=process_pending, args=(pg_settings,))
    worker.start()
    assert applying.wait(30)
    eraser = threading.Thread(target=erase_user, args=(pg_settings, "ann"))
    eraser.start()
    time.sleep(0.3)
    assert eraser.is_alive()  # blocked on the signal row the worker holds
    release.set()
    worker.join(30)
    eraser.join(30)
    with session_scope(pg_settings) as session:
        assert set(rows_about(session, pg_settings, "ann").values()) == {0}
        assert session.scalars(select(Signal)).all() == []


def test_cli_erase_user(pg_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    populate(pg_settings, "ann")
    monkeypatch.setenv("REVERIE_DATABASE_URL", pg_settings.database_url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["erase-user", "ann"])
        assert result.exit_code == 0, result.output
        assert "erased user ann: " in result.output
        empty = CliRunner().invoke(app, ["erase-user", "ann", "--json"])
        assert '"total": 0' in empty.output
    finally:
        get_settings.cache_clear()
    with session_scope(pg_settings) as session:
        assert set(rows_about(session, pg_settings, "ann").values()) == {0}


def test_the_vectors_of_the_users_keys_go_with_the_user(store_settings: Settings) -> None:
    # A key can name a person: the vectors the key matcher kept for the erased user's keys
    # go. Another user's keys keep theirs (a key both had is run again when next seen).
    from sqlalchemy import func

    from store import key_vectors
    from store.models import KeyVector
    from tasks.dream import dream_users
    from tests.dream_seed import entry, seed
    from worker.keymatch import forget_matchers, get_matcher

    settings = store_settings.model_copy(update={"summarize_interactions": False, "key_matching": "embedding"})
    seed(
        settings,
        [
            entry("ann", "contact_jane_doe_phone", "555-0101"),
            # Pruned (archived) by the dream: its vector was kept when it was current.
            entry("ann", "passport_of_jane_doe", "X123", age_days=900),
            entry("ann", "home_city", "Lisbon", agent="b"),
            entry("ben", "home_city", "Porto"),
            entry("ben", "favorite_color", "blue", agent="b"),
        ],
    )
    forget_matchers()
    matcher = get_matcher(settings)
    assert matcher.embedder is not None
    assert [o.entries_pruned for o in dream_users(settings, ["ann", "ben"])] == [1, 0]
    passport = matcher.normalise("passport_of_jane_doe")
    assert matcher.model_id is not None
    with session_scope(settings) as session:
        key_vectors.save(session, matcher.model_id, matcher.embed([passport]))

    def forms() -> set[str]:
        with session_scope(settings) as session:
            return set(session.scalars(select(KeyVector.norm_key)))

    jane, home, color = (matcher.normalise(k) for k in ("contact_jane_doe_phone", "home_city", "favorite_color"))
    assert {jane, home, color, passport} <= forms()
    counts = erase_user(settings, "ann")
    assert counts["dream_key_vectors"] == 3
    assert forms().isdisjoint({jane, home, passport}) and color in forms()
    # Ben's next dream runs his key again and keeps its vector.
    forget_matchers()
    assert all(o.status == "succeeded" for o in dream_users(settings, ["ben"]))
    assert {home, color} <= forms() and forms().isdisjoint({jane, passport})
    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(KeyVector)) == len(forms())
    forget_matchers()


def test_no_vector_of_a_key_the_users_signal_proposed_outlives_them(make_settings: Any) -> None:
    # A session end proposes "jane_doe_mobile_number"; the key matcher finds it means
    # ann's "contact_jane_doe_phone", and the fact lands there. The proposed key is in
    # none of ann's rows, so its vector is not stored (the process keeps it in memory),
    # and nothing of it is left once she is erased.
    from store.models import KeyVector
    from tests.dream_seed import entry, seed
    from tests.test_canonical_writes import say
    from worker.keymatch import forget_matchers, get_matcher

    settings = make_settings(known_entries_token_budget=0, key_matching="embedding")
    forget_matchers()
    seed(settings, [entry("ann", "contact_jane_doe_phone", "555-0101")])
    [decision] = say(settings, "ann", "My jane doe mobile number is 555-0199.").accepted
    assert decision.key == "contact_jane_doe_phone" and "same meaning" in decision.outcome
    matcher = get_matcher(settings)
    proposed, held = matcher.normalise("jane_doe_mobile_number"), matcher.normalise("contact_jane_doe_phone")

    def forms() -> set[str]:
        with session_scope(settings) as session:
            return set(session.scalars(select(KeyVector.norm_key)))

    assert held in forms() and proposed not in forms()
    erase_user(settings, "ann")
    assert forms().isdisjoint({held, proposed})
    forget_matchers()
