"""Many rows into one of Reverie's tables at once."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, insert
from sqlalchemy.orm import Session

from store.db import driver_cursor


def insert_rows(session: Session, model: Any, rows: list[dict[str, Any]]) -> int:
    """Insert ``rows`` (dicts of column values) into ``model``'s table in the session's
    transaction. On PostgreSQL, rows that all name the same columns go in with one
    ``COPY``: an executemany spends most of its time binding each row's parameters.
    JSON columns keep their meaning either way (a Python None is JSON ``null``, as the
    ORM stores it)."""
    if not rows:
        return 0
    columns = list(rows[0])
    if session.get_bind().dialect.name != "postgresql" or any(list(row) != columns for row in rows):
        session.execute(insert(model), rows)
        return len(rows)
    from psycopg.types.json import Jsonb

    table = model.__table__
    unknown = set(columns) - set(table.columns.keys())
    if unknown:
        raise ValueError(f"not columns of {table.name}: {sorted(unknown)}")
    json_at = [i for i, name in enumerate(columns) if isinstance(table.columns[name].type, JSON)]
    statement = f"COPY {table.name} ({', '.join(columns)}) FROM STDIN"  # names checked above
    with driver_cursor(session) as cursor, cursor.copy(statement) as copy:
        for row in rows:
            values = [row[name] for name in columns]
            for i in json_at:
                values[i] = Jsonb(values[i])
            copy.write_row(values)
    return len(rows)
