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
text is then counted too and never exceeds the budget. No model call is made here:
where a policy has the model write a profile, :mod:`tasks.profile_writer` does, and
the profile built here is what is kept when the model's is refused or not written.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

from sqlalchemy import ColumnElement, Table
from sqlalchemy.orm import Session

from store import entry_state
from store import profiles as profile_store
from store.memories import table_for
from store.profiles import NO_AGENT, Fingerprint
from store.types import db_now
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
    latest = None
    for stamp in (row.updated_at, row.created_at, row.last_recalled_at):
        if stamp is not None and (latest is None or stamp > latest):
            latest = stamp
    return latest if latest is not None else datetime.min


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


class Entry(NamedTuple):
    """A row as a profile shows it: formatted and placed once, for all its profiles."""

    rank: tuple[Any, ...]
    section: int
    text: str
    shared: bool
    owner: str | None


def ranked_entries(rows: Sequence[Any]) -> list[Entry]:
    """The rows' lines, in the documented order (each row formatted once)."""
    entries = [
        Entry(
            rank_key(row),
            _section(row),
            fmt.entry_line(row.key, row.value, conflicted=bool(row.conflicted)),
            row.visibility == "global",
            row.source_agent_id,
        )
        for row in rows
    ]
    # The rank ends with the row's id, so no two ranks are equal: the order is total,
    # and any subset of a ranked list is itself ranked.
    entries.sort(key=_rank_of)
    return entries


def _rank_of(entry: Entry) -> tuple[Any, ...]:
    return entry.rank


def visible_entries(ranked: Sequence[Entry], agent_id: str) -> list[Entry]:
    """:func:`visible_to`, on ranked entries (the order is kept)."""
    if agent_id == NO_AGENT:
        return [e for e in ranked if e.shared]
    return [e for e in ranked if e.shared or e.owner == agent_id]


def header_tokens(count: Counter) -> list[int]:
    return [count(fmt.header_line(s)) for s in range(len(fmt.SECTIONS))]


def build(rows: Sequence[Any], budget: int, count: Counter) -> Built:
    """The profile of these rows (already filtered for visibility and staleness) cut to
    ``budget`` tokens as ``count`` counts them."""
    return build_ranked(ranked_entries(rows), budget, count, header_tokens(count))


def build_ranked(ranked: Sequence[Entry], budget: int, count: Counter, headers: list[int]) -> Built:
    """:func:`build` of entries already ranked, with the section headers' tokens."""
    total = len(ranked)
    lines: list[Line] = []
    running = 0
    for entry in ranked:
        # Lines past the point where the entries alone exceed the budget can never fit.
        if running > budget:
            break
        tokens = count(entry.text)
        running += tokens
        lines.append(Line(entry.section, tokens, entry.text))
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


@dataclass(frozen=True)
class Plan:
    """What a refresh read: the users whose memory changed, their rows (with ``stale``),
    the database's time of the read, and the stored text of each of their profiles."""

    at: datetime
    users: list[str]
    rows: dict[str, list[Any]]
    current: dict[tuple[str, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Composed:
    """The profile rows of a refresh, per user, ready to be written."""

    rows: dict[str, list[dict[str, Any]]]

    def tokens(self, users: Collection[str]) -> dict[str, list[int]]:
        return {u: [int(r["tokens"]) for r in self.rows[u]] for u in users if u in self.rows}


class Writer(Protocol):
    """Writes one profile with the model, or returns None to keep the deterministic one."""

    def __call__(
        self, user_id: str, agent: str, built: Built, allowed: dict[str, int], current: str | None
    ) -> Built | None: ...


def plan(session: Session, settings: Settings, user_ids: Collection[str], *, book: PolicyBook) -> Plan:
    """Read what a refresh needs, in the caller's (short) transaction: which users among
    ``user_ids`` changed since their profiles were built (a set-based look: unchanged
    ones cost nothing more), and their rows in one statement. Staleness is judged on the
    database's clock, the one every host shares."""
    table = table_for(settings)
    changed = profile_store.changed_users(session, table, user_ids)
    at = db_now(session)
    if not changed:
        return Plan(at, [], {})
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
    current = profile_store.texts(session, changed) if writes_with_model(book) else {}
    return Plan(at, changed, by_user, current)


def writes_with_model(book: PolicyBook) -> bool:
    """Whether any policy of the book has the model write its profiles."""
    return any(p.writes_profiles_with_model for p in (book.default, *book.agents.values()))


def compose(settings: Settings, read: Plan, *, book: PolicyBook, writer: Writer | None = None) -> Composed:
    """Build the profiles of the users ``read`` found changed, outside any transaction.

    Every agent owning a shown entry gets a profile, and the user gets the agent-less
    one. Where that agent's policy (the defaults', for the agent-less one) has the model
    write it and ``writer`` is given, the writer's profile replaces the deterministic
    one; the deterministic one stays when the writer returns None."""
    count = counter(settings)
    budget = budget_for(settings)
    tokenizer = llm.model_name(settings)
    out: dict[str, list[dict[str, Any]]] = {}
    headers = header_tokens(count)
    for user_id in read.users:
        mine = read.rows[user_id]
        # The fingerprint of exactly the rows read, so a change landing meanwhile shows next time.
        print_ = Fingerprint.of(mine)
        shown = [r for r in mine if not r.stale]
        agents = sorted({r.source_agent_id for r in shown if r.source_agent_id} - {NO_AGENT})
        # Each row is formatted and ranked once for all of the user's profiles (a global
        # entry is in every one of them).
        ranked = ranked_entries(shown)
        out[user_id] = []
        for agent in [NO_AGENT, *agents]:
            visible = visible_entries(ranked, agent)
            built = build_ranked(visible, budget, count, headers)
            writer_name = "deterministic"
            if writer is not None and book.for_agent(agent or None).writes_profiles_with_model:
                allowed = {e.text: e.section for e in visible}
                written = writer(user_id, agent, built, allowed, read.current.get((user_id, agent)))
                if written is not None:
                    built, writer_name = written, "model"
            out[user_id].append(
                _row(user_id, agent, built, tokenizer=tokenizer, at=read.at, print_=print_, writer=writer_name)
            )
    return Composed(out)


def save(session: Session, composed: Composed, user_ids: Collection[str]) -> int:
    """Make the composed profiles of ``user_ids`` their only ones (one delete, one insert)."""
    users = [u for u in user_ids if u in composed.rows]
    return profile_store.replace_profiles(session, users, [r for u in users for r in composed.rows[u]])


def refresh(
    session: Session, settings: Settings, user_ids: Collection[str], *, book: PolicyBook
) -> dict[str, list[int]]:
    """Rebuild, deterministically and in the caller's transaction, the profiles of the
    users among ``user_ids`` whose memory changed since their profiles were built;
    returns, per rebuilt user, the tokens of each profile it has now. (A dream run reads,
    builds and writes in three steps instead, so that no transaction stays open while
    text is built or the model writes: see ``tasks.dream``.)"""
    read = plan(session, settings, user_ids, book=book)
    if not read.users:
        return {}
    composed = compose(settings, read, book=book)
    save(session, composed, read.users)
    return composed.tokens(read.users)


def counter(settings: Settings) -> Counter:
    """The configured model's token count, with the tokenizer looked up once and each
    short text (a line, a header: global entries recur in every agent's profile)
    counted once per refresh."""
    count_text = llm.text_counter(settings)
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        if not text:
            return 0
        if len(text) > fmt.COUNT_WINDOW_CHARS:
            return count_text(text)
        known = cache.get(text)
        if known is None:
            known = cache[text] = count_text(text)
        return known

    return count


def _row(
    user_id: str, agent: str, built: Built, *, tokenizer: str, at: datetime, print_: Fingerprint, writer: str
) -> dict[str, Any]:
    return {
        "user_id": user_id,
        "agent_id": agent,
        "text": built.text,
        "tokens": built.tokens,
        "budget": built.budget,
        "entries_included": built.included,
        "entries_left_out": built.left_out,
        "layout": {**built.layout.to_json(), "writer": writer},
        "tokenizer": tokenizer,
        "built_at": at,
        "source_rows": print_.rows,
        "source_updated_at": print_.updated_at,
        "source_recalls": print_.recalls,
        "source_conflicted": print_.conflicted,
        "source_content": print_.content,
    }
