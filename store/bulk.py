"""Many rows into one of Reverie's tables at once."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import JSON, insert
from sqlalchemy.orm import Session

from store.db import driver_cursor


class JsonText(str):
    """A JSON column's value already made JSON text (written as it is, not made again)."""

    __slots__ = ()


def insert_rows(session: Session, model: Any, rows: list[dict[str, Any]]) -> int:
    """Insert ``rows`` (dicts of column values) into ``model``'s table in the session's
    transaction. On PostgreSQL, rows that all name the same columns go in with one
    ``COPY``: an executemany spends most of its time binding each row's parameters.
    JSON columns keep their meaning either way (a Python None is JSON ``null``, as the
    ORM stores it; a :class:`JsonText` is the JSON it holds)."""
    if not rows:
        return 0
    columns = list(rows[0])
    if session.get_bind().dialect.name != "postgresql" or any(list(row) != columns for row in rows):
        session.execute(insert(model), [_parsed(row) for row in rows])
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
                # JSON text is COPY's own form of a JSON value: written as it is.
                values[i] = values[i] if type(values[i]) is JsonText else Jsonb(values[i])
            copy.write_row(values)
    return len(rows)


def _parsed(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its :class:`JsonText` values as the values they hold (for the ORM)."""
    if not any(type(value) is JsonText for value in row.values()):
        return row
    return {name: json.loads(value) if type(value) is JsonText else value for name, value in row.items()}
