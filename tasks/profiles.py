"""Profiles: each user's memory as each agent may see it, as text under a token budget.

Visibility is EDDI's: an agent sees its own ``self`` and ``group`` entries and every
``global`` entry, never another agent's ``self`` entries; the agent-less profile holds
the global entries only. A ``self`` entry no agent owns (``source_agent_id`` NULL or
empty: a signal with no agent wrote it) is another agent's for none of them, and is
shown as a global one is; a ``group`` entry no agent owns is shown in no profile (its
audience is its groups). Entries pruning would remove (stale) are never shown.

Ranking, most important first (what does not fit is left out from the end):
1. the day the entry was created, last updated or recalled (the latest), newest first;
2. ``access_count``, most recalled first;
3. category: ``property``, ``fact``, ``preference``, ``context``, any other, ``legacy``;
4. that latest time exactly, newest first; then key and id.

Tokens are counted with the configured model's tokenizer through the LLM gateway, one
line at a time, so a reader can cut to a smaller budget without a tokenizer; the whole
text is then counted too and never exceeds the budget. No model call is made here:
where a policy has the model write a profile, :mod:`tasks.profile_writer` does, and
the profile built here is what is kept when the model's is refused or not written.
"""

from __future__ import annotations

import json
import threading
from collections import Counter as Tally
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from operator import itemgetter
from typing import Any, NamedTuple, Protocol

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from store import profiles as profile_store
from store.bulk import JsonText
from store.memories import table_for
from store.profiles import CATEGORY_PRIORITY, MAX_AGENT_ID, NO_AGENT, OTHER_CATEGORY_PRIORITY, Fingerprint
from store.types import db_now, naive_utc
from worker import llm, metrics
from worker import profile_text as fmt
from worker.errors import DatabaseUnavailable, TransientError
from worker.logs import get_logger, user_ref
from worker.policy import Policy, PolicyBook
from worker.profile_text import Layout, Line
from worker.settings import Settings

Counter = Callable[[str], int]

log = get_logger(__name__)


@dataclass(frozen=True)
class Built:
    """One profile's text and what a reader needs to cut it further."""

    text: str
    tokens: int
    budget: int
    included: int
    left_out: int
    layout: Layout
    #: The lines the model was offered when it wrote this profile, each with its section
    #: (kept with it, so the
    #: next pass knows what changed since): None for a profile the model did not write.
    offered: tuple[tuple[int, str], ...] | None = None


def _touched(row: Any) -> datetime:
    latest = None
    for stamp in (row.updated_at, row.created_at, row.last_recalled_at):
        if stamp is None:
            continue
        stamp = naive_utc(stamp)  # a host's column with a time zone: as UTC
        if latest is None or stamp > latest:
            latest = stamp
    return latest if latest is not None else datetime.min


_MICROSECOND = timedelta(microseconds=1)


def rank_key(row: Any) -> tuple[Any, ...]:
    """The documented order (see the module docstring), as a sort key."""
    touched = _touched(row)
    category = (row.category or "fact").lower()
    return (
        -touched.toordinal(),
        -int(row.access_count or 0),
        CATEGORY_PRIORITY.get(category, OTHER_CATEGORY_PRIORITY),
        # In whole microseconds: as seconds, a float holds today's times to 8 microseconds only.
        -((touched - datetime.min) // _MICROSECOND),
        row.key,
        row.id,
    )


class Entry(NamedTuple):
    """A row as a profile shows it: formatted and placed once, for all its profiles."""

    section: int
    text: str
    shared: bool
    owner: str | None
    #: How many of the text's characters come before the space that starts its value
    #: (its key's part, ``- key:``; 0: none does): see :meth:`TokenCount.lines`.
    head: int = 0


def ranked_entries(rows: Sequence[Any]) -> list[Entry]:
    """The lines of rows holding their value (``.value``), in the documented order."""
    keyed = [
        (
            rank_key(row),
            _entry(
                row.key,
                fmt.value_text(row.value),
                row.category,
                row.visibility,
                row.source_agent_id,
                conflicted=row.conflicted,
            ),
        )
        for row in rows
    ]
    # The rank ends with the row's id, so no two ranks are equal: the order is total,
    # and any subset of a ranked list is itself ranked.
    keyed.sort(key=_first)
    return [entry for _, entry in keyed]


def read_entries(rows: Sequence[Any], *, ranked: bool) -> list[Entry]:
    """The lines of rows a build read (``store.profiles.read_for_build``: their value as
    JSON text), in the documented order: the database's where it ranked them."""
    if not ranked:
        keyed = [(rank_key(row), _read_entry(row)) for row in rows]
        keyed.sort(key=_first)
        return [entry for _, entry in keyed]
    return [_read_entry(row) for row in rows]


def _read_entry(row: Any) -> Entry:
    key, value_json, category, visibility, owner, conflicted = _SHOWN(row)
    return _entry(key, fmt.json_value_text(value_json), category, visibility, owner, conflicted=conflicted)


#: The columns of a build's row a line is made of (``store.profiles.SHOWN_COLUMNS``, after the user's id).
_SHOWN = itemgetter(*range(1, len(profile_store.SHOWN_COLUMNS)))


def _entry(
    key: str, shown: str, category: str | None, visibility: str | None, owner: str | None, *, conflicted: Any
) -> Entry:
    text, head = fmt.line_and_head(key, shown, bool(conflicted))
    # A ``self`` entry no agent owns (written with no agent: a session end without one,
    # or an application's write with no owner) is no agent's own: every profile shows
    # it. A ``group`` entry with no owner keeps to its groups, which a profile does not
    # know, and a visibility EDDI does not have widens nothing: no profile shows them.
    shared = visibility == "global" or (not owner and (visibility or "self") == "self")
    return Entry(fmt.section_of(category, key), text, shared, owner or None, head)


_first = itemgetter(0)


def header_tokens(count: Counter) -> list[int]:
    return [count(fmt.header_line(s)) for s in range(len(fmt.SECTIONS))]


def build(rows: Sequence[Any], budget: int, count: Counter) -> Built:
    """The profile of these rows (already filtered for visibility and staleness) cut to
    ``budget`` tokens as ``count`` counts them."""
    return build_ranked(ranked_entries(rows), budget, count, header_tokens(count))


def build_ranked(
    ranked: Sequence[Entry], budget: int, count: Counter, headers: list[int], *, by_lines: bool = False
) -> Built:
    """:func:`build` of entries already ranked, with the section headers' tokens.

    ``by_lines``: ``count`` counts a text as the sum of its lines' counts within each of
    its counting windows (:func:`worker.profile_text.windowed_tokens`), so the text's
    count is made from its lines' instead of counting it whole again."""
    return build_lines(lines_of(ranked, count), budget, count, headers, by_lines=by_lines)


def lines_of(ranked: Sequence[Entry], count: Counter) -> list[Line]:
    """The entries' lines with their tokens (in the entries' order)."""
    return [Line(entry.section, count(entry.text), entry.text) for entry in ranked]


def build_lines(lines: Sequence[Line], budget: int, count: Counter, headers: list[int], *, by_lines: bool) -> Built:
    """:func:`build_ranked` of the ranked entries' lines, already counted."""
    total = len(lines)
    layout = Layout(lines, headers, left_out_tokens(count, total), total)
    if by_lines:
        whole = fmt.whole_if_fits(layout, budget, count)
        if whole is not None:
            # Every line fits in one counting window: the text's count is its parts'.
            return Built(whole[0], whole[1], budget, total, 0, layout)
    if fmt.lines_fit(layout, total, budget):
        # Every line, where the whole text's count fits (a reader keeps a whole profile
        # whole on the same terms: by its count, not by the estimate a cut is made with).
        text, tokens = _counted(lines, total, total, headers, count=count, by_lines=by_lines)
        if tokens <= budget:
            return Built(text, tokens, budget, total, 0, layout)
    kept = fmt.cut(layout, budget)
    text, tokens = _counted(lines, kept, total, headers, count=count, by_lines=by_lines)
    while tokens > budget and kept > 0:
        # The estimate is an upper bound for tokenizers that split at line starts; for
        # any other, the whole text's own count decides.
        kept -= 1
        text, tokens = _counted(lines, kept, total, headers, count=count, by_lines=by_lines)
    if tokens > budget or kept == 0:
        # No entry fits: an empty profile (a left-out line alone tells a prompt nothing).
        text, tokens = "", 0
    stored = layout if kept == total else Layout(lines[:kept], headers, layout.left_out_tokens, total)
    return Built(text, tokens, budget, kept, total - kept, stored)


def left_out_tokens(count: Counter, total: int) -> int:
    """The most tokens the left-out line can take in a profile of ``total`` entries,
    whatever number it shows (1 to ``total``: a cut, the builder's or a reader's at any
    smaller budget, may leave out any of them). Not just the count of ``total``'s line:
    a tokenizer need not count a larger number in more tokens (Anthropic's counts
    ``(531 more entries left out)`` in 9, and 532's in 8)."""
    if not total:
        return 0
    if isinstance(count, TokenCount):
        return count.left_out(total)
    return max(count(fmt.left_out_line(n)) for n in range(1, total + 1))


def _counted(
    lines: Sequence[Line], kept: int, total: int, headers: list[int], *, count: Counter, by_lines: bool
) -> tuple[str, int]:
    """The text of the first ``kept`` lines and its tokens."""
    if not by_lines:
        text = fmt.assemble(lines[:kept], total - kept)
        return text, count(text)
    pieces = fmt.pieces(lines[:kept], total - kept, headers, count)
    return "".join(map(_first, pieces)), fmt.windowed_tokens(pieces, count)


def _cutoff(policy: Policy, at: datetime) -> datetime | None:
    return at - timedelta(days=policy.pruneStaleAfterDays) if policy.prunes else None


def budget_for(settings: Settings) -> int:
    return settings.profile_token_budget


@dataclass(frozen=True)
class Plan:
    """What a refresh read: the users whose memory changed, their shown rows (not
    stale; ``ranked`` if they come in the profiles' order), the fingerprint of each
    one's rows as read, the database's time of the read, and the stored text of each
    of their profiles."""

    at: datetime
    users: list[str]
    rows: dict[str, list[Any]]
    prints: dict[str, Fingerprint] = field(default_factory=dict)
    current: dict[tuple[str, str], profile_store.Current] = field(default_factory=dict)
    ranked: bool = False
    #: Users read only because the model wrote profiles their agents' policies no longer
    #: have it write (their memory and the settings unchanged): only those agents'
    #: profiles are built again, and the users' others stay as they are.
    only: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Composed:
    """The profile rows of a refresh, per user, ready to be written."""

    rows: dict[str, list[dict[str, Any]]]
    #: Users of whom only these agents' profiles are replaced (:attr:`Plan.only`).
    only: dict[str, set[str]] = field(default_factory=dict)
    #: Users whose profiles could not be built (their old ones stay), with the error's type.
    failed: dict[str, str] = field(default_factory=dict)
    #: Users not built because the database or the model's service went away meanwhile
    #: (their old profiles stay; what was built before is kept), and that error's type.
    deferred: list[str] = field(default_factory=list)
    deferred_by: str = ""

    @property
    def unbuilt(self) -> set[str]:
        """The users read as changed whose profiles were not built (failed or deferred)."""
        return {*self.failed, *self.deferred}

    @property
    def users(self) -> list[str]:
        return sorted(self.rows)

    def tokens(self, users: Collection[str]) -> dict[str, list[int]]:
        return {u: [int(r["tokens"]) for r in self.rows[u]] for u in users if u in self.rows}


class Writer(Protocol):
    """Writes one profile with the model, or returns None to keep the deterministic one."""

    def __call__(
        self,
        user_id: str,
        agent: str,
        built: Built,
        allowed: Mapping[str, int],
        current: profile_store.Current | None,
    ) -> Built | None: ...


def plan(
    session: Session,
    settings: Settings,
    user_ids: Collection[str],
    *,
    book: PolicyBook,
    changed: Collection[str] = (),
) -> Plan:
    """Read what a refresh needs, in the caller's (short) transaction: which users among
    ``user_ids`` changed since their profiles were built, or have profiles built with
    another budget or tokenizer than the settings' now (a set-based look: unchanged
    ones cost nothing more; ``changed`` names users known to have changed, such as
    those a run just pruned), and their rows: on PostgreSQL, all in one statement.
    Staleness is judged on the database's clock, the one every host shares."""
    table = table_for(settings)
    at = db_now(session)
    # A profile the model wrote for an agent whose policy no longer has it written by
    # the model is built again now, whether or not the memory changed: turning the
    # model writer off takes effect at the next pass. (Turning it on waits for the
    # user's next change: it costs a model call per profile.)
    withdrawn: dict[str, set[str]] = {}
    for user_id, agent in profile_store.model_written(session, user_ids):
        if not book.for_agent(agent or None).writes_profiles_with_model:
            withdrawn.setdefault(user_id, set()).add(agent)
    built_with = profile_store.BuiltWith(budget_for(settings), llm.model_name(settings))
    found = profile_store.read_for_build(
        session,
        table,
        user_ids,
        changed={*changed, *withdrawn},
        agent_cutoffs={agent: _cutoff(policy, at) for agent, policy in book.agents.items()},
        default_cutoff=_cutoff(book.default, at),
        protected_categories=settings.protected_category_set,
        last_access_column=settings.memory_last_access_column,
        built_with=built_with,
    )
    if not found.users:
        return Plan(at, [], {})
    current = profile_store.texts(session, found.users) if writes_with_model(book) else {}
    only = _withdrawn_only(session, withdrawn, found, changed, built_with)
    return Plan(at, found.users, found.rows, found.prints, current, found.ranked, only)


def _withdrawn_only(
    session: Session,
    withdrawn: dict[str, set[str]],
    found: profile_store.BuildRead,
    changed: Collection[str],
    built_with: profile_store.BuiltWith,
) -> dict[str, set[str]]:
    """Of the users with profiles the model should no longer write (``withdrawn``: their
    agents), those read for that alone: their rows as read are what their profiles were
    built from, with the settings of now. Their other profiles stay (a model-written one
    is not written again, at a model call's cost, for a change that is not its own)."""
    candidates = [u for u in withdrawn if u in found.prints and u not in changed]
    stored = profile_store.built_from(session, candidates)
    return {
        user_id: withdrawn[user_id]
        for user_id in candidates
        if user_id in stored and stored[user_id] == (found.prints[user_id], built_with)
    }


def writes_with_model(book: PolicyBook) -> bool:
    """Whether any policy of the book has the model write its profiles."""
    return any(p.writes_profiles_with_model for p in (book.default, *book.agents.values()))


def compose(
    settings: Settings,
    read: Plan,
    *,
    book: PolicyBook,
    writer: Writer | None = None,
    interrupts: tuple[type[BaseException], ...] = (),
    built: Callable[[str, list[dict[str, Any]]], None] | None = None,
) -> Composed:
    """Build the profiles of the users ``read`` found changed, outside any transaction.

    Every agent owning a shown entry gets a profile, and the user gets the agent-less
    one. Where that agent's policy (the defaults', for the agent-less one) has the model
    write it and ``writer`` is given, the writer's profile replaces the deterministic
    one; the deterministic one stays when the writer returns None. ``interrupts`` (the
    task's soft time limit), like the database or the model's service going away, stop
    the build: what was built is kept, and the users left are :attr:`Composed.deferred`.
    A writer that may make no more calls (:class:`OutOfTime`) defers that user alone:
    the others are built as long as they need no call. A user stopped midway keeps the
    profiles built before the stop (those the model was paid for), replacing only those
    agents' and marked to be built again at the next pass. ``built(user, rows)`` is
    called with each user's rows as they are built (to keep what the model was paid for
    at once)."""
    count = counter(settings)
    budget = budget_for(settings)
    tokenizer = llm.model_name(settings)
    out: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    # Each row is formatted (and ranked) once for all of the user's profiles (a global
    # entry is in every one of them), and all the lines are counted before any profile
    # is built: together, where the tokenizer allows.
    entries: dict[str, list[Entry]] = {}
    for user_id in read.users:
        try:
            entries[user_id] = read_entries(read.rows[user_id], ranked=read.ranked)
        except Exception as exc:  # a value no code foresaw: that user's profiles alone stay as they were
            failed[user_id] = _failed(settings, user_id, exc)
    counted = iter(count.lines([e for mine in entries.values() for e in mine]))
    lines_of_user = {user_id: [next(counted) for _ in mine] for user_id, mine in entries.items()}
    headers = header_tokens(count.recurring)
    whole = Whole(budget, headers) if count.by_lines else None
    deferred: list[str] = []
    deferred_by = ""
    stopped: dict[str, set[str]] = {}
    for index, (user_id, mine) in enumerate(entries.items()):
        partial: list[dict[str, Any]] = []
        try:
            out[user_id] = _compose_user(
                partial,
                user_id,
                mine,
                lines_of_user[user_id],
                read,
                book=book,
                writer=writer,
                budget=budget,
                headers=headers,
                count=count,
                whole=whole,
                tokenizer=tokenizer,
            )
            if built is not None:
                built(user_id, out[user_id])
        except OutOfTime:
            # This user waits for the next pass (what the model was paid for is kept); the
            # others are built as long as they need no model call.
            deferred.append(user_id)
            deferred_by = OutOfTime.__name__
            _keep_partial(user_id, partial, out, stopped, built)
        except _NOT_ONE_USERS + interrupts as exc:
            # Not this user's doing: the rest wait for the next pass, and what was built
            # (model calls paid for) is kept, this user's profiles built so far included.
            deferred, deferred_by = [*deferred, *list(entries)[index:]], type(exc).__name__
            _keep_partial(user_id, partial, out, stopped, built)
            break
        except Exception as exc:
            # One user's rows must not cost the others their profiles, nor the model calls
            # already made for them (a chunk built again user by user would make them twice).
            failed[user_id] = _failed(settings, user_id, exc)
    only = {u: agents for u, agents in read.only.items() if u in out} | stopped
    return Composed(out, only, failed, deferred, deferred_by)


def _keep_partial(
    user_id: str,
    rows: list[dict[str, Any]],
    out: dict[str, list[dict[str, Any]]],
    stopped: dict[str, set[str]],
    built: Callable[[str, list[dict[str, Any]]], None] | None,
) -> None:
    """Keep the profiles of a user built before their build stopped: written for those
    agents only, with a fingerprint no rows have, so the next pass builds the user again
    (where the model, offered the same lines, is not asked again)."""
    if not rows:
        return
    marked = [{**row, "source_rows": -1} for row in rows]
    out[user_id] = marked
    stopped[user_id] = {row["agent_id"] for row in marked}
    if built is not None:
        built(user_id, marked)


def _compose_user(
    out: list[dict[str, Any]],
    user_id: str,
    ranked: list[Entry],
    counts: list[int],
    read: Plan,
    *,
    book: PolicyBook,
    writer: Writer | None,
    budget: int,
    headers: list[int],
    count: TokenCount,
    whole: Whole | None,
    tokenizer: str,
) -> list[dict[str, Any]]:
    """The rows of one user's profiles (:func:`compose`), appended to ``out`` as each is built."""
    # The fingerprint of exactly the rows read, so a change landing meanwhile shows next time.
    print_ = read.prints[user_id]
    lines = [Line(entry.section, tokens, entry.text) for entry, tokens in zip(ranked, counts, strict=True)]
    seen = Visibility(ranked)
    line_json = _LineJson(lines)
    agents = [NO_AGENT, *seen.agents]
    if user_id in read.only:
        agents = [agent for agent in agents if agent in read.only[user_id]]
    for agent in agents:
        shown = seen.of(agent)
        by_model = writer is not None and book.for_agent(agent or None).writes_profiles_with_model
        if whole is not None and not by_model:
            fits = whole.row(lines, shown, count.left_out, line_json)
            if fits is not None:
                out.append(_row(user_id, agent, fits, tokenizer=tokenizer, at=read.at, print_=print_))
                continue
        visible = [lines[i] for i in shown]
        built = build_lines(visible, budget, count, headers, by_lines=count.by_lines)
        writer_name = "deterministic"
        if writer is not None and by_model:
            # Each line the model may write, and how many of the entries show it (two
            # entries can show one line: the same key and value, owned otherwise).
            allowed = Tally(line.text for line in visible)
            written = writer(user_id, agent, built, allowed, read.current.get((user_id, agent)))
            if written is not None:
                built, writer_name = written, "model"
        out.append(_row(user_id, agent, built, tokenizer=tokenizer, at=read.at, print_=print_, writer=writer_name))
    return out


def _failed(settings: Settings, user_id: str, exc: Exception) -> str:
    """Log and count one user's failed build (named by type only: a message can quote a value)."""
    error_type = type(exc).__name__
    log.error("dream.profiles_failed", user=user_ref(user_id, settings.log_hash_key), error_type=error_type)
    metrics.PROFILE_FAILURES.inc()
    return error_type


class OutOfTime(TransientError):
    """Raised by a writer that would make a call: the pass's or the chunk's time for
    model work is up, so none starts now."""


#: Errors that are not one user's: the database or the model's service went away, or
#: the time for model work is up (:class:`OutOfTime`, ``worker.errors.Interrupted``).
_NOT_ONE_USERS = (TransientError, DatabaseUnavailable, OperationalError)


@dataclass(frozen=True)
class Fitted:
    """A profile that holds every line it may (:meth:`Whole.row`), its layout as JSON text."""

    text: str
    tokens: int
    budget: int
    included: int
    layout: JsonText
    left_out: int = 0


class Visibility:
    """Which of a user's ranked entries each agent may see, as their indexes in rank
    order: its own ``self`` and ``group`` entries and every shared one (``global``, or
    a ``self`` one owned by no agent; '': the agent-less profile, the shared entries
    only). ``agents``: every agent owning an entry (each gets a profile)."""

    def __init__(self, ranked: Sequence[Entry]) -> None:
        self.shared: list[int] = []
        self.own: dict[str, list[int]] = {}
        owners: set[str] = set()
        for i, entry in enumerate(ranked):
            if entry.owner:
                owners.add(entry.owner)
            if entry.shared:
                self.shared.append(i)
            elif entry.owner:
                self.own.setdefault(entry.owner, []).append(i)
        # An owner longer than a profile's agent id can be (a host's own column may hold
        # one) gets no profile of its own: its entries are in no profile.
        self.agents = sorted(a for a in owners - {NO_AGENT} if len(a) <= MAX_AGENT_ID)

    def of(self, agent: str) -> list[int]:
        own = self.own.get(agent) if agent != NO_AGENT else None
        return sorted(self.shared + own) if own else self.shared


class Whole:
    """The profiles that hold every line their agent may see and fit the budget and one
    counting window (nearly all of them: the budget holds a few dozen lines), built the
    short way: each line's JSON made once per user, the text and its count made from
    the lines'. Exactly what :func:`build_lines` makes of them (a test holds the two
    equal); the others go that way. For a counter whose text counts are made from its
    lines' (``TokenCount.by_lines``)."""

    def __init__(self, budget: int, headers: list[int]) -> None:
        self.budget = budget
        self.headers = headers
        self._headers_json = json.dumps(headers)

    def row(
        self,
        lines: Sequence[Line],
        shown: Sequence[int],
        left_out: Callable[[int], int],
        line_json: Callable[[], list[str]],
    ) -> Fitted | None:
        """The profile of the lines at ``shown`` (indexes of ``lines``, in rank order),
        or None where it does not fit; ``left_out(total)``: :func:`left_out_tokens`;
        ``line_json()``: each line's JSON (``lines[i]``'s at ``i``)."""
        parts: list[str] = []
        tokens = 0
        current = -1
        headers = self.headers
        for section, line_tokens, text in sorted(map(lines.__getitem__, shown), key=_section):
            if section != current:
                current = section
                parts.append(fmt.header_line(section))
                tokens += headers[section]
            parts.append(text)
            tokens += line_tokens
        if tokens > self.budget:
            return None
        text = "".join(parts)
        if len(text) > fmt.COUNT_WINDOW_CHARS:
            return None
        total = len(shown)
        layout = (
            f'{{"lines":[{",".join(map(line_json().__getitem__, shown))}],"headers":{self._headers_json},'
            f'"left_out_line":{left_out(total)},"total":{total},"writer":"deterministic"}}'
        )
        return Fitted(text, tokens, self.budget, total, JsonText(layout))


_section = itemgetter(0)


class _LineJson:
    """A user's lines' JSON (:func:`_line_json`), made at the first call, once."""

    def __init__(self, lines: Sequence[Line]) -> None:
        self._lines = lines
        self._made: list[str] | None = None

    def __call__(self) -> list[str]:
        if self._made is None:
            self._made = [_line_json(line) for line in self._lines]
        return self._made


def _line_json(line: Line) -> str:
    """``[section, tokens, text]`` as JSON (as ``Layout.to_json`` and ``json.dumps`` make it)."""
    return f"[{line.section},{line.tokens},{_json_string(line.text)}]"


_json_string = json.encoder.encode_basestring_ascii


def save(session: Session, composed: Composed, user_ids: Collection[str]) -> int:
    """Make the composed profiles of ``user_ids`` their only ones (one delete, one insert),
    or, for a user of whom only some agents' profiles were built (:attr:`Composed.only`),
    those agents' only ones."""
    users = [u for u in user_ids if u in composed.rows and u not in composed.only]
    written = profile_store.replace_profiles(session, users, [r for u in users for r in composed.rows[u]])
    partial = [u for u in user_ids if u in composed.rows and u in composed.only]
    pairs = [(u, agent) for u in partial for agent in composed.only[u]]
    rows = [r for u in partial for r in composed.rows[u]]
    return written + profile_store.replace_agent_profiles(session, pairs, rows)


def mark_for_rebuild(session: Session, user_ids: Collection[str]) -> None:
    """Have the users' profiles built again at their next dream, whatever their rows' fingerprint says."""
    profile_store.mark_for_rebuild(session, user_ids)


def refresh(
    session: Session, settings: Settings, user_ids: Collection[str], *, book: PolicyBook
) -> dict[str, list[int]]:
    """Rebuild, deterministically and in the caller's transaction, the profiles of the
    users among ``user_ids`` whose memory changed since their profiles were built;
    returns, per rebuilt user, the tokens of each profile it has now. (A dream run reads,
    builds and writes in three steps instead, so that no transaction stays open while
    text is built or the model writes: see ``tasks.dream``.)"""
    composed = rebuild(session, settings, user_ids, book=book)
    return composed.tokens(composed.users)


def rebuild(session: Session, settings: Settings, user_ids: Collection[str], *, book: PolicyBook) -> Composed:
    """:func:`refresh`, returning what was built and who was not (:attr:`Composed.unbuilt`).

    No model call is made here: where a policy has the model write profiles, those users'
    profiles are built deterministically now and marked, so the model writes them at
    the user's next dream (their memory changed: a restore)."""
    read = plan(session, settings, user_ids, book=book)
    if not read.users:
        return Composed({})
    composed = compose(settings, read, book=book)
    save(session, composed, read.users)
    if writes_with_model(book):
        mark_for_rebuild(session, composed.users)
    return composed


class TokenCount:
    """The configured model's token count (a callable), with the tokenizer looked up once
    and each short text (a line, a header: global entries recur in every agent's
    profile) counted once per refresh; :meth:`recurring` counts the texts every chunk
    has (a key's part of a line, a header, a left-out line) once per process. Where the
    tokenizer allows (the built-in model's), :meth:`lines` counts many lines in one
    call, and a text's count is made of its lines' (``by_lines``)."""

    def __init__(self, settings: Settings) -> None:
        self._count = llm.text_counter(settings)
        self._lines = llm.line_counter(settings)
        self._cache: dict[str, int] = {}
        self.by_lines = self._lines is not None

    def __call__(self, text: str) -> int:
        if not text:
            return 0
        if len(text) > fmt.COUNT_WINDOW_CHARS:
            return self._count(text)
        known = self._cache.get(text)
        if known is None:
            known = self._cache[text] = self._count(text)
        return known

    def recurring(self, text: str) -> int:
        """:meth:`__call__` of a text that recurs from chunk to chunk and holds no value
        (a key's part of a line, a header, a left-out line), counted once per process
        and tokenizer (the built-in one, or one litellm resolves): at most
        ``RECURRING_TEXTS`` of them, the least recently used let go first."""
        return _recurring_count(self._count, text) if len(text) <= RECURRING_CHARS else self(text)

    def left_out(self, total: int) -> int:
        """:func:`left_out_tokens` (kept per process and tokenizer)."""
        return _LEFT_OUT.bound(self._count, total) if total else 0

    def lines(self, entries: Sequence[Entry]) -> list[int]:
        """Each entry's line's count (in order): all in one call where the tokenizer
        allows (not kept: a profile's lines are its user's own, counted once per refresh).

        There, a line's count is its key's part's (``- key:``, kept: keys recur) plus the
        rest's (`` value\n``, counted with the other lines' rests): cl100k's pre-tokenizer
        always ends a piece at a colon followed by a space, and starts the next one
        afresh, so the two parts are tokenized alone as within the line (a test holds
        the sum to the whole line's count)."""
        if self._lines is None:
            return [self(entry.text) for entry in entries]
        rests = self._lines([entry.text[entry.head :] for entry in entries])
        return [
            tokens + self.recurring(entry.text[: entry.head]) if entry.head else tokens
            for entry, tokens in zip(entries, rests, strict=True)
        ]


def counter(settings: Settings) -> TokenCount:
    return TokenCount(settings)


#: :meth:`TokenCount.recurring`'s texts are this short at most (a key's part of a line
#: is at most 64 characters); it keeps this many counts per tokenizer.
RECURRING_CHARS = 64
RECURRING_TEXTS = 65_536


@lru_cache(maxsize=RECURRING_TEXTS)
def _recurring_count(count: Counter, text: str) -> int:
    """``count(text)``, kept (a tokenizer's counts never change)."""
    return count(text) if text else 0


class _LeftOutBounds:
    """:func:`left_out_tokens` per tokenizer: for each total, the most tokens of the
    left-out lines of 1 to that total, grown as larger totals come (each number's line
    counted once per process). Kept for the last few counters (a counter is one per
    tokenizer, or one per refresh where litellm has none to hand out)."""

    KEPT = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[Counter, list[int]] = {}

    def bound(self, count: Counter, total: int) -> int:
        with self._lock:
            bounds = self._bounds.pop(count, None) or [0]
            self._bounds[count] = bounds  # the most recently used, last
            while len(self._bounds) > self.KEPT:
                del self._bounds[next(iter(self._bounds))]
            while len(bounds) <= total:
                bounds.append(max(bounds[-1], count(fmt.left_out_line(len(bounds)))))
            return bounds[total]


_LEFT_OUT = _LeftOutBounds()


def _row(
    user_id: str,
    agent: str,
    built: Built | Fitted,
    *,
    tokenizer: str,
    at: datetime,
    print_: Fingerprint,
    writer: str = "deterministic",
) -> dict[str, Any]:
    layout: JsonText | dict[str, Any]
    if isinstance(built, Fitted):
        layout = built.layout
    else:
        layout = {**built.layout.to_json(), "writer": writer}
        if built.offered is not None:
            layout["offered"] = [[section, text] for section, text in built.offered]
    return {
        "user_id": user_id,
        "agent_id": agent,
        "text": built.text,
        "tokens": built.tokens,
        "budget": built.budget,
        "entries_included": built.included,
        "entries_left_out": built.left_out,
        "layout": layout,
        "tokenizer": tokenizer,
        "built_at": at,
        "source_rows": print_.rows,
        "source_updated_at": print_.updated_at,
        "source_recalls": print_.recalls,
        "source_conflicted": print_.conflicted,
        "source_content": print_.content,
    }
