"""Summarize: compress groups of related entries with the model, under the cost cap.

A group is the entries of one agent, one category (NULL counts as ``fact``) and one
visibility (``group`` entries also one set of ``group_ids``), so a summary is never
visible wider than its sources and never mixes two agents' ``self`` entries. Groups
of at least ``summarizeMinEntries`` become at most ``summarizeTargetEntries`` entries.
Each model call happens outside any transaction; the replacement is one transaction
afterwards (see :mod:`store.summaries`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from store.db import session_scope
from store.entry_state import GDPR_PREFIX
from store.memories import table_for, user_entries
from store.summaries import NewEntry, replace_group
from worker import metrics
from worker.errors import BudgetExhausted, TransientError
from worker.logs import get_logger, user_ref
from worker.policy import PolicyBook
from worker.settings import Settings

log = get_logger(__name__)

MAX_KEY = 100
MAX_VALUE = 1000
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)

GroupKey = tuple[str | None, str, str, str]


@dataclass
class SummaryCounts:
    summarized: int = 0
    written: int = 0
    deferred: int = 0
    cost_usd: float = 0.0
    budget_scope: str | None = None


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
        if row.key.startswith(GDPR_PREFIX) or category in protected or row.conflicted:
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
    """The model's items, defensively: fences stripped, items without key or value
    dropped, keys cut to 100 characters and values to 1,000 (at most ``target`` if given)."""
    body = text.strip()
    fenced = _FENCE.search(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        data = json.loads(body)
    except ValueError:
        start, end = body.find("["), body.rfind("]")
        if start < 0 or end <= start:
            return []
        try:
            data = json.loads(body[start : end + 1])
        except ValueError:
            return []
    if isinstance(data, dict):
        data = next((data[k] for k in ("entries", "items", "memories") if isinstance(data.get(k), list)), [data])
    if not isinstance(data, list):
        return []
    items: list[NewEntry] = []
    seen: set[str] = set()
    for item in data:
        if not isinstance(item, dict):
            continue
        key, value = item.get("key"), item.get("value")
        if not isinstance(key, str) or not key.strip() or value is None or value == "":
            continue
        key = key.strip()[:MAX_KEY]
        if key.startswith(GDPR_PREFIX) or key in seen:
            continue
        text_value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        items.append(NewEntry(key=key, value=text_value[:MAX_VALUE]))
        seen.add(key)
    return items if target is None else items[:target]


def summarize_user(
    settings: Settings,
    user_id: str,
    *,
    book: PolicyBook,
    owners: Collection[str] | None,
    run_id: int | None,
    keep_alive: Callable[[], None] = lambda: None,
) -> SummaryCounts:
    """Summarize the user's groups; model errors other than transient ones propagate.

    Transient model errors and groups changed meanwhile are deferred to the next run;
    when a budget runs out, the call is not made and every remaining group is deferred.
    """
    from worker import llm

    table = table_for(settings)
    with session_scope(settings) as session:
        rows = user_entries(session, table, user_id)
    groups = groups_of(rows, settings, book, owners)
    counts = SummaryCounts()
    for index, group in enumerate(groups):
        keep_alive()
        agent = group[0].source_agent_id
        target = book.for_agent(agent).summarizeTargetEntries
        try:
            reply = llm.complete(
                settings,
                purpose="summarize",
                messages=build_messages(group, target),
                max_tokens=settings.llm_max_output_tokens,
                run_id=run_id,
                agent_id=agent,
            )
        except BudgetExhausted as exhausted:
            counts.deferred += len(groups) - index
            counts.budget_scope = exhausted.scope
            log.info("summarize_budget_exhausted", user=user_ref(user_id), scope=exhausted.scope)
            break
        except TransientError as exc:
            counts.deferred += 1
            log.info("summarize_group_deferred", user=user_ref(user_id), reason=str(exc)[:200])
            continue
        counts.cost_usd += reply.cost_usd
        items = parse_reply(reply.text)
        if not items or len(items) >= len(group):
            # Nothing usable, or no smaller than what it would replace: leave the group.
            continue
        items = items[:target]
        with session_scope(settings) as session:
            new_ids = replace_group(session, table, group, items, run_id=run_id)
        if new_ids is None:
            counts.deferred += 1
            continue
        counts.summarized += len(group)
        counts.written += len(new_ids)
        metrics.MEMORY_WRITES.labels(source="summarize", action="insert").inc(len(new_ids))
        metrics.MEMORY_WRITES.labels(source="summarize", action="delete").inc(len(group))
    return counts
