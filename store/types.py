"""Column types and SQL functions that behave the same on PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, BigInteger, Integer, select
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
