"""Queries on ``dream_spend``: budgets, reservations and settled spend, in nano-USD.

A reservation is one conditional ``UPDATE`` per budget line
(``reserved + spent + amount <= limit``), all in the caller's transaction: either
every line takes it or the transaction is rolled back and nothing is reserved. The
row lock each ``UPDATE`` takes serialises concurrent workers on the same budget,
and the table's check constraint backs the cap up.

Every reservation is also a row of ``dream_reservations`` until it is settled, with
the deadline by which its call must have ended: :func:`reap` settles the ones whose
process died before it could (see :mod:`worker.budget`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, delete, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import Reservation, Spend
from store.types import now


@dataclass(frozen=True)
class BudgetLine:
    """One budget a model call must fit: ``scope`` is ``run``, ``day``, ``user`` or
    ``signal``. A line that ``follows_settings`` takes its limit from the caller at
    every reservation, so a changed setting applies at once."""

    scope: str
    key: str
    limit_nano: int
    follows_settings: bool = False


def user_digest(user_id: str) -> str:
    """What stands in for a user id in the key of that user's budget lines."""
    return hashlib.sha256(user_id.encode("utf-8")).hexdigest()[:32]


def user_day_key(day: str, user_id: str) -> str:
    # User ids are up to 255 characters; the key column holds 64.
    return f"{day}/{user_digest(user_id)}"


def delete_user_lines(session: Session, user_id: str) -> int:
    """Remove a user's own budget lines (erasure); returns how many."""
    statement = delete(Spend).where(Spend.scope == "user", Spend.scope_key.like(f"%/{user_digest(user_id)}"))
    return int(getattr(session.execute(statement), "rowcount", 0) or 0)


class Refused(Exception):
    """The reservation does not fit ``line``; ``remaining_nano`` is what it had left."""

    def __init__(self, line: BudgetLine, remaining_nano: int) -> None:
        self.line = line
        self.remaining_nano = remaining_nano
        super().__init__(line.scope)


def ensure_lines(session: Session, lines: list[BudgetLine]) -> None:
    """Create the budget rows that do not exist yet. An existing row keeps its limit,
    unless the line ``follows_settings``: then it takes the line's limit, raised or
    lowered, but never below what the row has already reserved and spent (the check
    constraint's floor), so a lowered cap refuses every further call at once."""
    at = now()
    postgres = session.get_bind().dialect.name == "postgresql"
    for line in lines:
        values = {"scope": line.scope, "scope_key": line.key, "limit_nano": line.limit_nano, "updated_at": at}
        statement = pg_insert(Spend).values(**values) if postgres else sqlite_insert(Spend).values(**values)
        if not line.follows_settings:
            session.execute(statement.on_conflict_do_nothing())
            continue
        used = Spend.reserved_nano + Spend.spent_nano
        session.execute(
            statement.on_conflict_do_update(
                index_elements=[Spend.scope, Spend.scope_key],
                set_={"limit_nano": case((used > line.limit_nano, used), else_=line.limit_nano), "updated_at": at},
                where=Spend.limit_nano != line.limit_nano,
            )
        )


def reserve(session: Session, lines: list[BudgetLine], amount_nano: int) -> None:
    """Take ``amount_nano`` from every line, or raise :class:`Refused` for the first
    that cannot give it (the caller must then roll back)."""
    at = now()
    # A fixed order (the list's: run before day) so two workers never lock in reverse.
    for line in lines:
        taken = session.execute(
            update(Spend)
            .where(
                Spend.scope == line.scope,
                Spend.scope_key == line.key,
                Spend.reserved_nano + Spend.spent_nano + amount_nano <= Spend.limit_nano,
            )
            .values(reserved_nano=Spend.reserved_nano + amount_nano, updated_at=at)
            .returning(Spend.scope_key)
        ).first()
        if taken is None:
            raise Refused(line, remaining_nano(session, line))


def lock_headroom(session: Session, lines: list[BudgetLine]) -> tuple[BudgetLine, int]:
    """Lock the budget rows (in the list's order, as :func:`reserve` does) and return
    the tightest line with what it has left; the caller's transaction keeps the locks,
    so a reservation sized from this answer cannot be overtaken on PostgreSQL."""
    tightest, least = lines[0], None
    for line in lines:
        row = session.execute(
            select(Spend.limit_nano, Spend.reserved_nano, Spend.spent_nano)
            .where(Spend.scope == line.scope, Spend.scope_key == line.key)
            .with_for_update()
        ).first()
        left = line.limit_nano if row is None else int(row.limit_nano) - int(row.reserved_nano) - int(row.spent_nano)
        if least is None or left < least:
            tightest, least = line, left
    return tightest, max(0, least or 0)


def record_reservation(session: Session, lines: list[BudgetLine], amount_nano: int, deadline: datetime) -> int:
    """Remember a reservation just taken (same transaction); returns its id."""
    statement = insert(Reservation).values(
        lines=[[line.scope, line.key] for line in lines], amount_nano=amount_nano, deadline=deadline
    )
    return int(session.execute(statement.returning(Reservation.id)).scalar_one())


def settle(session: Session, reservation_id: int, lines: list[BudgetLine], reserved_nano: int, spent_nano: int) -> bool:
    """Turn a reservation into spend: ``spent_nano`` (at most ``reserved_nano``) is
    recorded and the rest is released. False, and nothing changed, when the reaper
    has settled it already (it then recorded the whole reservation as spent)."""
    gone = session.execute(
        delete(Reservation).where(Reservation.id == reservation_id).returning(Reservation.id)
    ).first()
    if gone is None:
        return False
    _settle_lines(session, [(line.scope, line.key) for line in lines], reserved_nano, spent_nano)
    return True


def expired_reservations(session: Session, at: datetime, limit: int) -> list[int]:
    """Ids of reservations whose deadline passed before ``at``, oldest first."""
    statement = select(Reservation.id).where(Reservation.deadline < at).order_by(Reservation.deadline).limit(limit)
    return [int(value) for value in session.scalars(statement)]


def reap(session: Session, reservation_id: int) -> int | None:
    """Settle one expired reservation as spent in full (its call may have been
    billed); returns the amount, or None when it was settled meanwhile."""
    gone = session.execute(
        delete(Reservation)
        .where(Reservation.id == reservation_id)
        .returning(Reservation.lines, Reservation.amount_nano)
    ).first()
    if gone is None:
        return None
    amount = int(gone.amount_nano)
    _settle_lines(session, [(str(scope), str(key)) for scope, key in gone.lines], amount, amount)
    return amount


def _settle_lines(session: Session, lines: list[tuple[str, str]], reserved_nano: int, spent_nano: int) -> None:
    spent = max(0, min(spent_nano, reserved_nano))
    at = now()
    for scope, key in lines:
        session.execute(
            update(Spend)
            .where(Spend.scope == scope, Spend.scope_key == key)
            .values(
                reserved_nano=Spend.reserved_nano - reserved_nano,
                spent_nano=Spend.spent_nano + spent,
                updated_at=at,
            )
        )


def remaining_nano(session: Session, line: BudgetLine) -> int:
    row = session.execute(
        select(Spend.limit_nano, Spend.reserved_nano, Spend.spent_nano).where(
            Spend.scope == line.scope, Spend.scope_key == line.key
        )
    ).first()
    if row is None:
        return line.limit_nano
    return max(0, int(row.limit_nano) - int(row.reserved_nano) - int(row.spent_nano))


def spent_nano(session: Session, scope: str, key: str) -> int:
    """What was settled against one budget (0 when it has no row)."""
    value = session.scalar(select(Spend.spent_nano).where(Spend.scope == scope, Spend.scope_key == key))
    return int(value or 0)
