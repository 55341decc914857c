"""``reverie migrate`` and ``reverie demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from worker.cli.common import app, fail, load_settings


@app.command()
def migrate() -> None:
    """Bring the database at REVERIE_DATABASE_URL to the current schema (idempotent)."""
    from schedules.dispatcher import adopt
    from store.db import safe_url
    from store.memories import check_memory_table
    from store.migrate import upgrade

    settings = load_settings(database_must_exist=False)
    # A host's memory table Reverie cannot work on is said up front, by table and
    # column: not as a migration's SQL error, nor after a migration that succeeded.
    check_memory_table(settings)
    before, after = upgrade(settings)  # checks the connection (and the server) first
    where = safe_url(settings.database_url)
    if before == after:
        print(f"{where}: already at revision {after}; nothing to do")
    else:
        print(f"{where}: migrated from {before or 'an empty schema'} to revision {after}")
    # Users already in the memory table are scheduled now, not at beat's first adoption.
    adopted = adopt(settings)
    if adopted:
        print(f"scheduled {adopted} existing user(s), spread over the dream interval")


@app.command()
def demo(
    path: Annotated[Path, typer.Option("--path", help="The SQLite file to create (replaced if present).")] = Path(
        "reverie-demo.db"
    ),
) -> None:
    """Run the whole pipeline once on an embedded SQLite store: no broker, no network."""
    from worker.demo import run_demo

    if path.is_dir():
        fail(f"--path {path}: is a directory; give the name of the file to create", code=2)
    if not path.resolve().parent.is_dir():
        fail(f"--path {path}: its directory does not exist", code=2)

    run_demo(path)
