"""``reverie erase-user``: the right to erasure (contract section 4)."""

from __future__ import annotations

from store import erase as erase_store
from store.db import session_scope
from worker.logs import get_logger, user_ref
from worker.payloads import check_identifier
from worker.settings import Settings

log = get_logger(__name__)


def erase_user(settings: Settings, user_id: str) -> dict[str, int]:
    """Remove every row about ``user_id`` in one transaction; rows removed per table.

    Signals for the user enqueued before this call are dropped (including one a worker
    is processing: it finds its signal gone and writes nothing); signals enqueued
    afterwards are processed as usual. Raises ``InvalidSignal`` for an empty or
    malformed user id.
    """
    check_identifier("user_id", user_id, required=True)
    with session_scope(settings) as session:
        counts = erase_store.erase_user(session, settings, user_id)
    log.info("user_erased", user=user_ref(user_id, settings.log_hash_key), rows=sum(counts.values()))
    return counts
