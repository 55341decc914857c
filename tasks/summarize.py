"""Summarize: compress groups of related entries with the model, under the cost cap.

A group is the entries of one agent, one category (NULL counts as ``fact``) and one
visibility (``group`` entries also one set of ``group_ids``), so a summary is never
visible wider than its sources and never mixes two agents' ``self`` entries. Groups
of at least ``summarizeMinEntries`` become at most ``summarizeTargetEntries`` entries.
Each model call happens outside any transaction; the replacement is one transaction
afterwards (see :mod:`store.summaries`).

A reply replaces its group whole or not at all: a reply that is not JSON, is cut off,
holds an unusable item, a value over 1,000 characters or more items than the target
leaves the group untouched and deferred (a summary that silently lost part of the reply would
replace the originals by less than they said). Under the cost cap, when the budget
left cannot pay for a full output ceiling, the call is made with a smaller one (never
below what the group's own keys and values take) and the smaller groups that follow
are still tried; the run's ledger row counts the deferred groups (and says why). A
group refused by the budget or a transient error is tried again at the next pass; one
the model could not summarize (an unusable reply, which would most likely come back,
and be paid for, again) at the user's next scheduled dream.

A group whose prompt is longer than the model's context window is split in two halves
(each still at least ``summarizeMinEntries``), each summarized on its own; one too
small to split is skipped with that reason in the ledger, and the user's other groups
are summarized as usual.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from store.db import session_scope
from store.entry_state import is_reserved, protected_category
from store.memories import as_restored, restored_entries, table_for, user_entries
from store.summaries import NewEntry, replace_group
from store.types import usd_to_nano
from worker import metrics
from worker.errors import BudgetExhausted, ContextWindowExceeded, Interrupted, TransientError
from worker.logs import get_logger, user_ref
from worker.policy import PolicyBook
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.llm import LlmReply

log = get_logger(__name__)

MAX_KEY = 100
MAX_VALUE = 1000
#: Output tokens allowed on top of the group's own keys and values (JSON framing).
OUTPUT_SLACK_TOKENS = 16
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)

GroupKey = tuple[str | None, str, str, str]


class UnusableReply(ValueError):
    """A summary reply that cannot replace its group whole; the message says why."""


@dataclass
class SummaryCounts:
    summarized: int = 0
    written: int = 0
    deferred: int = 0
    cost_usd: float = 0.0
    budget_scope: str | None = None
    #: Why groups were deferred to the next run, with counts.
    reasons: Counter[str] = field(default_factory=Counter)
    #: Deferred groups worth another try soon (a run's cap used up by this run's other
    #: groups, a transient error, a group changed meanwhile); the others (an unusable
    #: reply, a group too long for the model, a cap that pays for no call: the day's,
    #: or a run's that paid for nothing) would most likely fail, or be refused, the same
    #: way again: they wait for the user's next scheduled dream.
    retry_soon: int = 0
    #: Groups the day's budget (or the user's for the day) could not pay for: tried
    #: again once the day's budgets are new, if the next scheduled dream is later.
    retry_next_day: bool = False

    def note(self) -> str | None:
        """One line for the run's ledger: what was deferred and why (None: nothing was)."""
        if not self.reasons:
            return None
        parts = [f"{count} x {reason}" for reason, count in self.reasons.most_common(5)]
        return f"summarize: {self.deferred} group(s) deferred: " + "; ".join(parts)


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, str) else json.dumps(decoded, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _group_ids_key(raw: Any) -> str:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = []
    return json.dumps(sorted(map(str, raw or [])))


def groups_of(rows: list[Any], settings: Settings, book: PolicyBook, owners: Collection[str] | None) -> list[list[Any]]:
    """The user's summarizable groups, in a stable order (largest first)."""
    protected = settings.protected_category_set
    groups: dict[GroupKey, list[Any]] = defaultdict(list)
    for row in rows:
        category = row.category or "fact"
        if is_reserved(row.key) or protected_category(category, protected) or row.conflicted:
            continue
        if owners is not None and row.source_agent_id not in owners:
            continue
        if not book.for_agent(row.source_agent_id).summarizes:
            continue
        audience = _group_ids_key(row.group_ids) if row.visibility == "group" else ""
        groups[(row.source_agent_id, category, row.visibility, audience)].append(row)
    eligible = [
        members
        for members in groups.values()
        if len(members) >= book.for_agent(members[0].source_agent_id).summarizeMinEntries
    ]
    return sorted(eligible, key=lambda g: (-len(g), str(g[0].source_agent_id), g[0].category or "", g[0].visibility))


def response_schema(target: int) -> dict[str, Any]:
    """The reply's shape, for models that can be held to a JSON schema (the wrapper
    object :func:`parse_reply` takes, as a session end's reply has): at most ``target``
    entries, each a key and a value within their limits."""
    entry = {
        "type": "object",
        "properties": {
            "key": {"type": "string", "minLength": 1, "maxLength": MAX_KEY},
            "value": {"type": "string", "minLength": 1, "maxLength": MAX_VALUE},
        },
        "required": ["key", "value"],
    }
    return {
        "type": "object",
        "properties": {"entries": {"type": "array", "items": entry, "minItems": 1, "maxItems": target}},
        "required": ["entries"],
    }


def build_messages(rows: list[Any], target: int) -> list[dict[str, str]]:
    """The summarize prompt (``[reverie:summarize]`` tag, JSON input after ``INPUT:``)."""
    task = {
        "category": rows[0].category or "fact",
        "target": target,
        "entries": [{"key": row.key, "value": _value_text(row.value)} for row in rows],
    }
    system = (
        "[reverie:summarize]\n"
        "You consolidate one user's long-term memory entries. Merge the entries given into at most "
        f"{target} entries that keep every durable fact. Reply with only a JSON array of objects "
        'with string fields "key" (snake_case, at most 100 characters) and "value".'
    )
    user = f"Consolidate these {len(rows)} entries into at most {target}.\nINPUT:\n" + json.dumps(
        task, ensure_ascii=False
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_reply(text: str, target: int | None = None) -> list[NewEntry]:
    """The model's summary items, all or nothing; raises :class:`UnusableReply`.

    Tolerated: code fences, prose around the JSON, a wrapper object (``entries``,
    ``items`` or ``memories``), non-string values (kept as JSON text). Refused, for the
    whole reply: no JSON, no items, an item without a non-empty string key and a value,
    a key over 100 characters, reserved (``_gdpr_``) or repeated, a value over 1,000
    characters, more than ``target`` items.
    """
    data = _json_of(text)
    if isinstance(data, dict):
        data = next((data[k] for k in ("entries", "items", "memories") if isinstance(data.get(k), list)), [data])
    if not isinstance(data, list):
        raise UnusableReply("the reply holds no JSON array of entries")
    if not data:
        raise UnusableReply("the reply has no entries")
    if target is not None and len(data) > target:
        raise UnusableReply(f"the reply has {len(data)} entries, more than the target of {target}")
    items: list[NewEntry] = []
    seen: set[str] = set()
    for item in data:
        key = item.get("key") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        if not isinstance(key, str) or not key.strip() or value is None or value == "":
            raise UnusableReply("an entry of the reply has no key or no value")
        key = key.strip()
        if len(key) > MAX_KEY or is_reserved(key) or key in seen:
            raise UnusableReply("an entry's key is too long, reserved or repeated")
        text_value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(text_value) > MAX_VALUE:
            raise UnusableReply(f"an entry's value is longer than {MAX_VALUE} characters")
        items.append(NewEntry(key=key, value=text_value))
        seen.add(key)
    return items


def _json_of(text: str) -> Any:
    body = text.strip()
    fenced = _FENCE.search(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        pass
    start, end = body.find("["), body.rfind("]")
    if start < 0 or end <= start:
        raise UnusableReply("the reply is not JSON")
    try:
        return json.loads(body[start : end + 1])
    except (ValueError, RecursionError):
        raise UnusableReply("the reply is not JSON") from None


def min_output_tokens(settings: Settings, group: list[Any]) -> int:
    """The smallest output ceiling worth a call: about what the group's keys and values
    take (a summary that keeps every fact needs about as much), at most the setting."""
    from worker import llm

    entries = [{"key": row.key, "value": _value_text(row.value)} for row in group]
    needed = llm.count_text_tokens(settings, json.dumps(entries, ensure_ascii=False)) + OUTPUT_SLACK_TOKENS
    return min(settings.llm_max_output_tokens, needed)


def summarize_user(
    settings: Settings,
    user_id: str,
    *,
    book: PolicyBook,
    owners: Collection[str] | None,
    run_id: int | None,
    keep_alive: Callable[[], None] = lambda: None,
    hold: Callable[[Session], None] = lambda session: None,
) -> SummaryCounts:
    """Summarize the user's groups; model errors other than transient ones propagate.

    Transient model errors, groups changed meanwhile and groups a run's cap used up by
    this pass cannot pay for are deferred to the next pass (``retry_soon``); groups the
    day's budget cannot pay for to the next day (``retry_next_day``); unusable replies
    (the group is left unchanged) and a run cap that pays for no call to the user's next
    scheduled dream. Entries a restore put back (the
    originals of a summary undone, say) are left out while they hold what it put back:
    summarizing them again would undo the restore.
    ``keep_alive`` runs before each group and ``hold`` inside each replacing
    transaction, before it commits; either may raise to stop (the run lost its lease).
    """
    table = table_for(settings)
    with session_scope(settings) as session:
        rows = user_entries(session, table, user_id)
        groups = groups_of(rows, settings, book, owners)
        if groups:
            # Only a user with something to summarize has restores looked up.
            restored = restored_entries(session, [user_id])
            if restored:
                rows = [r for r in rows if not as_restored(r, restored.get((user_id, str(r.id))))]
                groups = groups_of(rows, settings, book, owners)
    step = _Pass(settings, user_id, run_id, table, hold)
    for group in groups:
        keep_alive()
        policy = book.for_agent(group[0].source_agent_id)
        step.summarize(group, policy.summarizeTargetEntries, policy.summarizeMinEntries)
    return step.counts


class _Pass:
    """One user's summarization pass: the counts, and what the budget had left."""

    def __init__(
        self, settings: Settings, user_id: str, run_id: int | None, table: Any, hold: Callable[[Session], None]
    ) -> None:
        self.settings, self.user_id, self.run_id, self.table = settings, user_id, run_id, table
        self.hold = hold
        self.counts = SummaryCounts()
        # What the tightest budget had left when it last refused a call: later (smaller)
        # groups are tried only if their least reservation fits it.
        self.budget_left: int | None = None

    def _defer(self, reason: str, *, retry_soon: bool = False) -> None:
        self.counts.deferred += 1
        self.counts.retry_soon += retry_soon
        self.counts.reasons[reason[:160]] += 1
        log.info("summarize_group_deferred", user=user_ref(self.user_id), reason=reason[:200])

    def _out_of_budget(self) -> None:
        """A group the budget cannot pay for: tried again at the next pass only where a
        new run can pay for it, as when this run's cap ran out after paying for other
        groups. A run cap that paid for nothing here (too small for any call) would
        refuse it again: it waits for the next scheduled dream; the day's (or the user's
        for the day) until the day's budgets are new (:attr:`SummaryCounts.retry_next_day`).
        Re-dreaming after each dirty delay would only fill the ledger."""
        self.counts.deferred += 1
        self.counts.retry_soon += self.counts.budget_scope == "run" and self.counts.cost_usd > 0
        self.counts.retry_next_day = self.counts.retry_next_day or self.counts.budget_scope in ("day", "user")
        self.counts.reasons[f"{self.counts.budget_scope} budget exhausted"] += 1

    def summarize(self, group: list[Any], target: int, min_entries: int) -> None:
        try:
            reply = self._call(group, target)
        except ContextWindowExceeded:
            if len(group) < 2 * min_entries:
                self._defer("skipped: too long for the model's context window, too small to split")
                return
            log.info("summarize_group_split", user=user_ref(self.user_id), entries=len(group))
            half = len(group) // 2
            self.summarize(group[:half], target, min_entries)
            self.summarize(group[half:], target, min_entries)
            return
        if reply is None:
            return
        try:
            items = parse_reply(reply.text, target)
        except UnusableReply as exc:
            self._defer(f"unusable reply: {exc}")
            return
        if len(items) >= len(group):
            return  # no smaller than what it would replace: leave the group
        with session_scope(self.settings) as session:
            new_ids = replace_group(session, self.table, group, items, run_id=self.run_id)
            self.hold(session)
        if new_ids is None:
            self._defer("changed while summarized", retry_soon=True)
            return
        self.counts.summarized += len(group)
        self.counts.written += len(new_ids)
        metrics.MEMORY_WRITES.labels(source="summarize", action="insert").inc(len(new_ids))
        metrics.MEMORY_WRITES.labels(source="summarize", action="delete").inc(len(group))

    def _call(self, group: list[Any], target: int) -> LlmReply | None:
        """The model's reply for the group, or None (deferred, and counted)."""
        from worker import llm

        settings = self.settings
        messages = build_messages(group, target)
        floor = min_output_tokens(settings, group)
        if self.budget_left is not None and llm.reservation_floor_nano(settings, messages, floor) > self.budget_left:
            self._out_of_budget()
            return None
        try:
            reply = llm.complete(
                settings,
                purpose="summarize",
                messages=messages,
                max_tokens=settings.llm_max_output_tokens,
                min_tokens=floor,
                run_id=self.run_id,
                agent_id=group[0].source_agent_id,
                response_schema=response_schema(target),
            )
        except BudgetExhausted as exhausted:
            if self.budget_left is None:
                log.info("summarize_budget_exhausted", user=user_ref(self.user_id), scope=exhausted.scope)
            self.counts.budget_scope = exhausted.scope
            self.budget_left = usd_to_nano(exhausted.remaining)
            self._out_of_budget()
            return None
        except llm.MalformedReply as exc:
            self._defer(f"unusable reply: {exc.reason}")
            return None
        except Interrupted:
            raise  # the task's time is up: no other group is summarized now
        except TransientError as exc:
            self._defer(str(exc), retry_soon=True)
            return None
        self.counts.cost_usd += reply.cost_usd
        if self.budget_left is not None:
            self.budget_left = max(0, self.budget_left - usd_to_nano(reply.cost_usd))
        return reply
