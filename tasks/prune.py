"""Prune: archive and remove the user's stale entries, each by its owner's policy.

Stale means neither updated nor recalled for ``pruneStaleAfterDays`` (see
:mod:`store.entry_state`). One set-based archive-then-delete per run, in the caller's
transaction; ``_gdpr_`` keys and protected categories are never touched.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Table
from sqlalchemy.orm import Session

from store import entry_state
from store import profiles as profile_store
from store.memories import remove_entries, remove_entries_of_runs, table_for
from worker.policy import Policy, PolicyBook
from worker.settings import Settings


def _cutoff(policy: Policy, at: datetime) -> datetime | None:
    return at - timedelta(days=policy.pruneStaleAfterDays) if policy.prunes else None


def _stale_where(
    settings: Settings,
    table: Table,
    users: str | Collection[str],
    *,
    book: PolicyBook,
    owners: Collection[str] | None,
    at: datetime,
    array: bool = False,
) -> ColumnElement[bool]:
    """The users' stale entries, each judged by its owner's policy (see ``entry_state``)."""
    return entry_state.prunable_where(
        table,
        users,
        agent_cutoffs={agent: _cutoff(policy, at) for agent, policy in book.agents.items()},
        default_cutoff=_cutoff(book.default, at),
        owners=owners,
        protected_categories=settings.protected_category_set,
        last_access_column=settings.memory_last_access_column,
        array=array,
    )


def prune_user(
    session: Session,
    settings: Settings,
    user_id: str,
    *,
    book: PolicyBook,
    owners: Collection[str] | None,
    at: datetime,
    run_id: int | None,
) -> int:
    """Archive and delete the user's stale entries; returns how many were removed.

    Also notes recalls (``access_count`` growth) first, so an entry recalled since the
    last look is not stale.
    """
    table = table_for(settings)
    recalled = entry_state.observe_recalls(session, table, user_id, at)
    # A recall moves the entry up its profiles' ranking, though the rows' fingerprint
    # may not move by now (the recall was counted when a build last read them).
    profile_store.mark_for_rebuild(session, recalled)
    where = _stale_where(settings, table, user_id, book=book, owners=owners, at=at)
    removed = remove_entries(session, table, where, reason="prune", source="prune", run_id=run_id)
    entry_state.forget_missing(session, table, user_id)
    return len(removed)


def prune_users(
    session: Session, settings: Settings, runs: Mapping[str, int], *, book: PolicyBook, at: datetime
) -> dict[str, int]:
    """:func:`prune_user` for several users' whole-user runs at once (``runs``: user id
    -> run id), in the caller's transaction: one recall look, one archive-then-delete
    (each row archived under its own user's run) and one clean-up for all of them.
    Returns how many entries each user lost."""
    table = table_for(settings)
    users = sorted(runs)
    counts = dict.fromkeys(users, 0)
    if not users:
        return counts
    profile_store.mark_for_rebuild(session, entry_state.observe_recalls(session, table, users, at))
    array = session.get_bind().dialect.name == "postgresql"
    where = _stale_where(settings, table, users, book=book, owners=None, at=at, array=array)
    for removed in remove_entries_of_runs(session, table, where, runs, reason="prune", source="prune"):
        counts[removed.user_id] += 1
    entry_state.forget_missing(session, table, users)
    return counts
