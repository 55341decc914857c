"""Profiles: each user's memory as each agent may see it, as text under a token budget.

Visibility is EDDI's: an agent sees its own ``self`` and ``group`` entries and every
``global`` entry, never another agent's ``self`` entries; the agent-less profile holds
the global entries only. Entries pruning would remove (stale) are never shown.

Ranking, most important first (what does not fit is left out from the end):
1. the day the entry was last updated or recalled, newest first;
2. ``access_count``, most recalled first;
3. category: ``property``, ``fact``, ``preference``, ``context``, any other, ``legacy``;
4. the exact time it was last updated or recalled, newest first; then key and id.

Tokens are counted with the configured model's tokenizer through the LLM gateway, one
line at a time, so a reader can cut to a smaller budget without a tokenizer; the whole
text is then counted too and never exceeds the budget. No model call is made.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Table
from sqlalchemy.orm import Session

from store import entry_state
from store import profiles as profile_store
from store.memories import table_for
from store.profiles import NO_AGENT, Fingerprint
from store.types import now
from worker import llm
from worker import profile_text as fmt
from worker.policy import Policy, PolicyBook
from worker.profile_text import Layout, Line
from worker.settings import Settings

CATEGORY_PRIORITY = {"property": 0, "fact": 1, "preference": 2, "context": 3, "legacy": 5}
OTHER_CATEGORY_PRIORITY = 4

Counter = Callable[[str], int]


@dataclass(frozen=True)
class Built:
    """One profile's text and what a reader needs to cut it further."""

    text: str
    tokens: int
    budget: int
    included: int
    left_out: int
    layout: Layout


def _touched(row: Any) -> datetime:
    stamps = [s for s in (row.updated_at, row.created_at, row.last_recalled_at) if s is not None]
    return max(stamps) if stamps else datetime.min


def rank_key(row: Any) -> tuple[Any, ...]:
    """The documented order (see the module docstring), as a sort key."""
    touched = _touched(row)
    category = (row.category or "fact").lower()
    return (
        -touched.toordinal(),
        -int(row.access_count or 0),
        CATEGORY_PRIORITY.get(category, OTHER_CATEGORY_PRIORITY),
        -(touched - datetime.min).total_seconds(),
        row.key,
        row.id,
    )


def visible_to(rows: Sequence[Any], agent_id: str) -> list[Any]:
    """The rows ``agent_id`` may see ('' : the agent-less profile, global entries only)."""
    return [r for r in rows if r.visibility == "global" or (agent_id != NO_AGENT and r.source_agent_id == agent_id)]


def build(rows: Sequence[Any], budget: int, count: Counter) -> Built:
    """The profile of these rows (already filtered for visibility and staleness) cut to
    ``budget`` tokens as ``count`` counts them."""
    ranked = sorted(rows, key=rank_key)
    total = len(ranked)
    lines: list[Line] = []
    running = 0
    for row in ranked:
        # Lines past the point where the entries alone exceed the budget can never fit.
        if running > budget:
            break
        text = fmt.entry_line(row.key, row.value, conflicted=bool(row.conflicted))
        line = Line(_section(row), count(text), text)
        running += line.tokens
        lines.append(line)
    headers = [count(fmt.header_line(s)) for s in range(len(fmt.SECTIONS))]
    layout = Layout(lines, headers, count(fmt.left_out_line(total)) if total else 0, total)
    kept = fmt.cut(layout, budget)
    text = fmt.assemble(lines[:kept], total - kept)
    tokens = count(text)
    while tokens > budget and kept > 0:
        # The estimate is an upper bound for tokenizers that split at line starts; for
        # any other, the whole text's own count decides.
        kept -= 1
        text = fmt.assemble(lines[:kept], total - kept)
        tokens = count(text)
    if tokens > budget:
        text, tokens = "", 0
    stored = Layout(lines[:kept], headers, layout.left_out_tokens, total)
    return Built(text, tokens, budget, kept, total - kept, stored)


def _section(row: Any) -> int:
    return fmt.section_of(row.category, row.key)


def _cutoff(policy: Policy, at: datetime) -> datetime | None:
    return at - timedelta(days=policy.pruneStaleAfterDays) if policy.prunes else None


def _stale_where(settings: Settings, table: Table, users: Collection[str], book: PolicyBook, at: datetime) -> Any:
    condition: ColumnElement[bool] = entry_state.prunable_where(
        table,
        users,
        agent_cutoffs={agent: _cutoff(policy, at) for agent, policy in book.agents.items()},
        default_cutoff=_cutoff(book.default, at),
        owners=None,
        protected_categories=settings.protected_category_set,
        last_access_column=settings.memory_last_access_column,
    )
    return condition


def budget_for(settings: Settings) -> int:
    return settings.profile_token_budget


def refresh(
    session: Session, settings: Settings, user_ids: Collection[str], *, book: PolicyBook
) -> dict[str, list[int]]:
    """Rebuild the profiles of the users among ``user_ids`` whose memory changed since
    their profiles were built; returns, per rebuilt user, the tokens of each profile it has now.

    A set-based look finds the changed users (unchanged ones cost nothing more); their
    rows are read in one statement and their profiles replaced in one delete and one
    insert, in the caller's transaction. Every agent owning a shown entry gets a
    profile, and the user gets the agent-less one.
    """
    table = table_for(settings)
    changed = profile_store.changed_users(session, table, user_ids)
    if not changed:
        return {}
    at = now()
    rows = profile_store.entries_for_build(
        session,
        table,
        changed,
        stale=_stale_where(settings, table, changed, book, at),
        last_access_column=settings.memory_last_access_column,
    )
    by_user: dict[str, list[Any]] = {u: [] for u in changed}
    for row in rows:
        by_user[row.user_id].append(row)
    count = _counter(settings)
    budget = budget_for(settings)
    tokenizer = llm.model_name(settings)
    fresh: list[dict[str, Any]] = []
    made: dict[str, list[int]] = {}
    for user_id, mine in by_user.items():
        # The fingerprint of exactly the rows read, so a change landing meanwhile shows next time.
        print_ = Fingerprint.of(mine)
        shown = [r for r in mine if not r.stale]
        agents = sorted({r.source_agent_id for r in shown if r.source_agent_id} - {NO_AGENT})
        made[user_id] = []
        for agent in [NO_AGENT, *agents]:
            built = build(visible_to(shown, agent), budget, count)
            fresh.append(_row(user_id, agent, built, tokenizer=tokenizer, at=at, print_=print_))
            made[user_id].append(built.tokens)
    profile_store.replace_profiles(session, changed, fresh)
    return made


def _counter(settings: Settings) -> Counter:
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        if not text:
            return 0
        if len(text) > 64:
            return llm.count_text_tokens(settings, text)
        # Headers and left-out lines recur in every profile of a refresh.
        if text not in cache:
            cache[text] = llm.count_text_tokens(settings, text)
        return cache[text]

    return count


def _row(
    user_id: str, agent: str, built: Built, *, tokenizer: str, at: datetime, print_: Fingerprint
) -> dict[str, Any]:
    return {
        "user_id": user_id,
        "agent_id": agent,
        "text": built.text,
        "tokens": built.tokens,
        "budget": built.budget,
        "entries_included": built.included,
        "entries_left_out": built.left_out,
        "layout": built.layout.to_json(),
        "tokenizer": tokenizer,
        "built_at": at,
        "source_rows": print_.rows,
        "source_updated_at": print_.updated_at,
        "source_recalls": print_.recalls,
        "source_conflicted": print_.conflicted,
        "source_content": print_.content,
    }
