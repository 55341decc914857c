"""Queries on ``dream_key_vectors``: the key-matching model's vectors, computed once.

A sweep over users whose keys were all seen before reads vectors and runs no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, delete, event, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, SessionTransaction

from store.models import KeyVector
from worker.keymatch import KeyMatcher
from worker.logs import get_logger

MAX_NORM_KEY = 512
# Keeps each IN list and insert well inside every driver's parameter limit.
BATCH = 500

log = get_logger(__name__)


def load(session: Session, model: str, norm_keys: Iterable[str]) -> dict[str, bytes]:
    """The stored vectors of these rules forms (those never stored are absent)."""
    wanted = sorted({k for k in norm_keys if len(k) <= MAX_NORM_KEY})
    found: dict[str, bytes] = {}
    for start in range(0, len(wanted), BATCH):
        rows = session.execute(
            select(KeyVector.norm_key, KeyVector.vector).where(
                KeyVector.model == model, KeyVector.norm_key.in_(wanted[start : start + BATCH])
            )
        )
        found.update({key: bytes(vector) for key, vector in rows})
    return found


def save(
    session: Session,
    model: str,
    vectors: Mapping[str, bytes],
    *,
    then: Callable[[], None] | None = None,
    lost: Callable[[], None] | None = None,
) -> None:
    """Store new vectors once the caller's transaction commits; one another worker stored
    first is kept, in key order. ``then`` is called once they are stored; ``lost`` if they
    are not (the caller's transaction rolled back, or the write failed): the caller may
    offer them again.

    They are stored only if the caller's work commits: a run that lost its user to an
    erasure meanwhile (its transaction rolled back) stores no vector of that user's keys
    after the erasure deleted them. On PostgreSQL they are then written in a transaction
    of their own: they hold no user id (an erasure deletes those of its user's keys:
    :func:`forget`), and a second worker storing the same keys waits for no one's long
    transaction. On SQLite they are written in the caller's (one writer at a time)."""
    rows = [{"model": model, "norm_key": k, "vector": v} for k, v in sorted(vectors.items()) if len(k) <= MAX_NORM_KEY]
    if not rows:
        return
    bind = session.get_bind()
    if bind.dialect.name != "postgresql":
        # SQLite has one writer: a second connection would wait for the caller's.
        _insert(session, sqlite_insert, rows)
        _once_committed(session, then, lost)
        return
    engine = bind.engine if isinstance(bind, Connection) else bind
    session.connection()  # the caller's transaction begun, so its end is the one waited for

    def store() -> None:
        try:
            with Session(bind=engine) as own, own.begin():
                _insert(own, pg_insert, rows)
        except Exception as exc:  # after the caller's commit: its work stands, whatever this does
            log.warning("key_vectors_not_stored", vectors=len(rows), error_type=type(exc).__name__)
            if lost is not None:
                lost()
            return
        if then is not None:
            then()

    _once_committed(session, store, lost)


def forget(session: Session, norm_keys: Iterable[str]) -> int:
    """Delete the vectors of these rules forms, of every model (an erased user's keys:
    a key can name a person). Another user's key of the same form is run through the
    model again when next seen. Returns the rows deleted."""
    wanted = sorted({k for k in norm_keys if len(k) <= MAX_NORM_KEY})
    if not wanted:
        return 0
    # The models named too: the table's key is (model, norm_key), so each batch is an
    # index lookup, not a scan of every vector kept.
    models = sorted(session.scalars(select(KeyVector.model).distinct()))
    deleted = 0
    for start in range(0, len(wanted), BATCH):
        batch = wanted[start : start + BATCH]
        result = session.execute(delete(KeyVector).where(KeyVector.model.in_(models), KeyVector.norm_key.in_(batch)))
        deleted += int(getattr(result, "rowcount", 0) or 0)
    return deleted


def _insert(session: Session, builder: Any, rows: list[dict[str, Any]]) -> None:
    for start in range(0, len(rows), BATCH):
        session.execute(builder(KeyVector).values(rows[start : start + BATCH]).on_conflict_do_nothing())


def prepare(session: Session, matcher: KeyMatcher, keys: Iterable[str], *, proposed: Iterable[str] = ()) -> int:
    """Give ``matcher`` a vector for every key of ``keys`` and ``proposed``: from its
    memory, else this table, else the model. New vectors of ``keys`` (keys rows hold)
    are stored here; those of ``proposed`` (keys a signal proposed, which may land on
    another key or nowhere) are kept in the process's memory only: an erasure finds the
    keys a user's rows hold, not those a model proposed from their words. Returns how
    many keys the model ran on. Nothing to do for a matcher without a model."""
    model = matcher.model_id
    if model is None:
        return 0
    held = list(keys)
    missing = matcher.missing([*held, *proposed])
    computed: dict[str, bytes] = {}
    new: dict[str, bytes] = {}
    if missing:
        matcher.remember(load(session, model, missing))
        computed = matcher.embed(missing)
        kept = {matcher.normalise(key) for key in held}
        new = {form: vector for form, vector in computed.items() if form in kept}
        matcher.hold_back(computed.keys() - new.keys())
    # And a proposed key's vector this process held back, now that a row holds the key.
    back = matcher.held_back(held)
    save(
        session,
        model,
        {**back, **new},
        then=lambda: matcher.stored(back),
        # Not stored (the caller's work rolled back): offered again by the next prepare
        # that finds a row holding the key.
        lost=lambda: matcher.hold_back(new),
    )
    return len(computed)


#: ``Session.info``'s key for what to do once the session's transaction ends.
_ON_END = "reverie.key_vectors.on_end"


def _once_committed(
    session: Session, then: Callable[[], None] | None, otherwise: Callable[[], None] | None = None
) -> None:
    """Call ``then`` when the session's transaction commits, ``otherwise`` if it rolls back."""
    pending = session.info.get(_ON_END)
    if pending is None:
        pending = session.info[_ON_END] = []
        event.listen(session, "after_commit", _committed)
        # Every rollback of the whole transaction, whether or not it had used a connection.
        event.listen(session, "after_soft_rollback", _rolled_back)
    pending.append((then, otherwise))


def _ended(session: Session) -> list[tuple[Callable[[], None] | None, Callable[[], None] | None]]:
    pending = session.info[_ON_END]
    done, pending[:] = list(pending), []
    return done


def _committed(session: Session) -> None:
    for then, _ in _ended(session):
        if then is not None:
            then()


def _rolled_back(session: Session, previous: SessionTransaction) -> None:
    if previous.nested:
        return  # a savepoint: the transaction goes on
    for _, otherwise in _ended(session):
        if otherwise is not None:
            otherwise()
