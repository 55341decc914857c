"""Retention: how long Reverie keeps what it stores, and the purge that enforces it.

Each kind of row has its own setting, in days (0 keeps it forever):

- archive rows (``archive_retention_days``): the window in which ``reverie restore``
  can undo a removal or an overwrite;
- payloads of finished signals (``signal_payload_retention_days``): the transcript or
  edit is emptied, the row and its idempotency key stay, so a duplicate still takes no
  effect; dead signals keep theirs for ``reverie signals retry``;
- events (``event_retention_days``), ledger runs (``run_retention_days``, never before
  their archive rows are gone) and budget lines (``spend_retention_days``).

The purge runs from beat and at the end of every cron pass. It works in batches of
``purge_batch_size`` rows, one short transaction each, through indexes on the age
columns: its cost follows the number of expired rows, not the size of the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from store import retention
from store.db import session_scope
from store.types import db_now
from worker.logs import get_logger
from worker.settings import Settings

log = get_logger(__name__)

#: One batch: (session, limit) -> rows touched.
Batch = Callable[[Session, int], int]


@dataclass
class PurgeReport:
    """How many rows each kind lost (payloads: how many were emptied)."""

    archive: int = 0
    signal_payloads: int = 0
    events: int = 0
    runs: int = 0
    spend: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


def purge_expired(settings: Settings, *, at: datetime | None = None) -> PurgeReport:
    """Purge everything past its retention at ``at`` (default: now on the database's
    clock, which stamped the rows: a host whose clock runs ahead purges nothing early)."""
    if at is None:
        with session_scope(settings) as session:
            at = db_now(session)
    report = PurgeReport()

    def before(days: int) -> datetime:
        return at - timedelta(days=days)

    if settings.archive_retention_days:
        cutoff = before(settings.archive_retention_days)
        report.archive = _drain(settings, lambda s, n: retention.purge_archive(s, cutoff=cutoff, limit=n))
    if settings.signal_payload_retention_days:
        cutoff = before(settings.signal_payload_retention_days)
        report.signal_payloads = _drain(
            settings, lambda s, n: retention.purge_signal_payloads(s, cutoff=cutoff, limit=n, at=at)
        )
    if settings.event_retention_days:
        cutoff = before(settings.event_retention_days)
        report.events = _drain(settings, lambda s, n: retention.purge_events(s, cutoff=cutoff, limit=n))
    if settings.run_retention_days and settings.archive_retention_days:
        # A run outlives its archive rows (restore reads them by run): while the archive
        # is kept forever, so are the runs.
        cutoff = before(max(settings.run_retention_days, settings.archive_retention_days))
        report.runs = _drain(settings, lambda s, n: retention.purge_runs(s, cutoff=cutoff, limit=n))
    if settings.spend_retention_days:
        cutoff = before(settings.spend_retention_days)
        day = cutoff.date().isoformat()
        report.spend = _drain(settings, lambda s, n: retention.purge_spend(s, cutoff=cutoff, cutoff_day=day, limit=n))
    if report.total:
        log.info("retention.purged", **asdict(report))
    return report


def _drain(settings: Settings, batch: Batch) -> int:
    total = 0
    while True:
        with session_scope(settings) as session:
            done = batch(session, settings.purge_batch_size)
        total += done
        if done < settings.purge_batch_size:
            return total
