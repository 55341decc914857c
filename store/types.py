"""Column types and SQL functions that behave the same on PostgreSQL and SQLite."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, BigInteger, ColumnClause, ColumnElement, Integer, case, literal, null, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement
from sqlalchemy.types import DateTime

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

#: JSONB on PostgreSQL, JSON text on SQLite.
JsonType = JSON().with_variant(JSONB(), "postgresql")

#: 64-bit ids on PostgreSQL; SQLite only autoincrements an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")

#: Naive UTC timestamps, the memory table's convention, used in every table.
Timestamp = DateTime(timezone=False)

NANO = 1_000_000_000  # money is stored as integer nano-USD: exact, atomic arithmetic


class utcnow(FunctionElement[datetime]):  # noqa: N801 - SQL function style
    """``now()`` in UTC without a time zone, as a server default or in a query."""

    type = Timestamp
    inherit_cache = True


@compiles(utcnow, "postgresql")
def _utcnow_pg(element: Any, compiler: Any, **kw: Any) -> str:
    return "timezone('utc', statement_timestamp())"


@compiles(utcnow, "sqlite")
def _utcnow_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


def now() -> datetime:
    """The current time as a naive UTC datetime (the memory table's convention)."""
    return datetime.now(UTC).replace(tzinfo=None)


def naive_utc(stamp: datetime) -> datetime:
    """``stamp`` in the memory table's convention: a time with a zone (a host's
    ``timestamptz`` column) as naive UTC; a naive one is UTC already."""
    return stamp.astimezone(UTC).replace(tzinfo=None) if stamp.tzinfo is not None else stamp


def db_now(session: Session) -> datetime:
    """The database's current time, naive UTC: the one clock every host shares. For
    any time compared with one another host wrote, or a column default wrote (leases,
    claims, due times, day keys). SQLite is embedded, so its clock is this host's."""
    if session.get_bind().dialect.name != "postgresql":
        return now()
    return session.execute(select(utcnow())).scalar_one()


def usd_to_nano(usd: float) -> int:
    return round(usd * NANO)


def nano_to_usd(nano: int) -> float:
    return nano / NANO


#: Where a host's time past what Python holds (``infinity``, the year 10000) is read: the
#: last day Python's times reach, a day short (no time zone's offset takes it past 9999).
LAST_TIME = datetime(9999, 12, 30)


def in_range_time(stamp: ColumnElement[Any]) -> ColumnElement[Any]:
    """A host's time as one Python holds (PostgreSQL): after the year 9999 (``infinity``
    included) as :data:`LAST_TIME`, before the year 1 (``-infinity``, a host's usual
    "never", and dates BC) as NULL, and every other time as it is (``0001-01-01``, Go's
    zero time, included). The driver reads no time outside Python's range: one such row
    would stop every read of its user's rows, pass after pass."""
    return case(
        (stamp > literal(datetime.max, stamp.type), literal(LAST_TIME, stamp.type)),
        (stamp < literal(datetime.min, stamp.type), null()),
        else_=stamp,
    )


def loadable_columns(columns: Iterable[ColumnElement[Any]], *, postgres: bool) -> list[ColumnElement[Any]]:
    """A memory table's ``columns`` (its own, or a subquery's of them) to read rows whole
    into Python: on PostgreSQL every time among them in Python's range
    (:func:`in_range_time`), under its own name."""
    return [
        in_range_time(column).label(column.name)
        if postgres and isinstance(column, ColumnClause) and isinstance(column.type, DateTime)
        else column
        for column in columns
    ]
