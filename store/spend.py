"""Queries on ``dream_spend``: budgets, reservations and settled spend, in nano-USD.

A reservation is one conditional ``UPDATE`` per budget line
(``reserved + spent + amount <= limit``), all in the caller's transaction: either
every line takes it or the transaction is rolled back and nothing is reserved. The
row lock each ``UPDATE`` takes serialises concurrent workers on the same budget,
and the table's check constraint backs the cap up.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from store.models import Spend
from store.types import now


@dataclass(frozen=True)
class BudgetLine:
    """One budget a model call must fit: ``scope`` is ``run`` or ``day``."""

    scope: str
    key: str
    limit_nano: int


class Refused(Exception):
    """The reservation does not fit ``line``; ``remaining_nano`` is what it had left."""

    def __init__(self, line: BudgetLine, remaining_nano: int) -> None:
        self.line = line
        self.remaining_nano = remaining_nano
        super().__init__(line.scope)


def ensure_lines(session: Session, lines: list[BudgetLine]) -> None:
    """Create the budget rows that do not exist yet (an existing limit is kept)."""
    at = now()
    for line in lines:
        values = {"scope": line.scope, "scope_key": line.key, "limit_nano": line.limit_nano, "updated_at": at}
        if session.get_bind().dialect.name == "postgresql":
            session.execute(pg_insert(Spend).values(**values).on_conflict_do_nothing())
        else:
            session.execute(sqlite_insert(Spend).values(**values).on_conflict_do_nothing())


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


def settle(session: Session, lines: list[BudgetLine], reserved_nano: int, spent_nano: int) -> None:
    """Turn a reservation into spend: ``spent_nano`` (at most ``reserved_nano``) is
    recorded and the rest is released."""
    spent = max(0, min(spent_nano, reserved_nano))
    at = now()
    for line in lines:
        session.execute(
            update(Spend)
            .where(Spend.scope == line.scope, Spend.scope_key == line.key)
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
