"""Model-written profiles: where an agent's policy has ``profileWriter: model``.

For a user whose memory changed, the model is shown the agent's current profile and
the entries the deterministic profile holds (each marked when it is new or changed
since that profile, with the lines the current profile shows that no entry backs any
more), and answers ``{"unchanged": true}`` or ``{"profile": "..."}``: a whole new
profile within the same fixed sections, as Unique's ``memory.md`` is kept.

Each call goes through the LLM gateway under the run's, the agent's and the day's caps
(reserved first), with ``purpose`` ``profile``. The answer is checked before it is
kept, and refused whole (the deterministic profile is kept, and the refusal counted)
when any bullet line is not, character for character, the line of an entry the agent
may see; a heading is not one of the fixed sections or comes out of their order; a
line is repeated or is anything else; or the profile, counted with the configured
model's tokenizer, is over the budget. ``unchanged`` keeps the current text on the
same terms (a line whose entry changed or went away refuses it). A call the budget
cannot pay for is not made, and none where the model would be offered exactly the
lines it wrote the current profile from (kept in its layout as ``offered``): that
profile is kept. A smaller budget on the reader's side keeps the start of a
model-written profile (its lines are ranked as the model wrote them).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from store.profiles import Current
from tasks.profiles import Built, OutOfTime
from worker import metrics
from worker import profile_text as fmt
from worker.errors import BudgetExhausted, Interrupted, PermanentError, TransientError
from worker.logs import get_logger, user_ref
from worker.profile_text import Layout, Line
from worker.settings import Settings

log = get_logger(__name__)

#: The lines a model is offered, each with its section.
Offered = tuple[tuple[int, str], ...]

PURPOSE = "profile"
#: Output tokens allowed on top of the budget: the JSON around the profile, and a
#: little per line for its quoting.
OUTPUT_SLACK_TOKENS = 32
OUTPUT_TOKENS_PER_LINE = 2
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)
#: The reply's two shapes, for models that can be held to a JSON schema (llama.cpp's
#: server makes a grammar of it: the reply is one of the two objects, whole).
RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "anyOf": [
        {"properties": {"unchanged": {"type": "boolean", "enum": [True]}}, "required": ["unchanged"]},
        {"properties": {"profile": {"type": "string"}}, "required": ["profile"]},
    ],
}
_HEADER = re.compile(r"^##\s+(?P<title>.+?)\s*$")
_LEFT_OUT = re.compile(r"^\(\d+ more (?:entry|entries) left out\)$")


class Refused(ValueError):
    """A model profile that cannot be kept; the message says why (never its text)."""


def build_messages(
    budget: int, current: str, lines: list[Line], *, changed: set[str], removed: list[str], left_out: int
) -> list[dict[str, str]]:
    """The profile prompt (``[reverie:profile]`` tag, JSON input after ``INPUT:``)."""
    task = {
        "budget_tokens": budget,
        "sections": list(fmt.SECTIONS),
        "current": current,
        "entries": [
            {"line": line.text.rstrip("\n"), "section": fmt.SECTIONS[line.section], "changed": line.text in changed}
            for line in lines
        ],
        "removed": [line.rstrip("\n") for line in removed],
        "left_out": left_out,
    }
    sections = ", ".join(f"## {name}" for name in fmt.SECTIONS)
    system = (
        "[reverie:profile]\n"
        "You keep the profile an assistant reads about one user: Markdown, with the headings "
        f"{sections} in that order (leave out a heading with no line under it), and one line per "
        "entry under them. You are given the current profile and the entries it may hold, each "
        "marked when it is new or changed, and the lines of the current profile whose entry changed "
        'or went away. Reply with only JSON: {"unchanged": true} if the current profile needs no '
        'change, else {"profile": "<the whole new profile>"}. Copy every line exactly, character for '
        "character, from the entries given: never add, merge or reword one. You may order the lines "
        f"by importance, move a line to another heading, and leave lines out. At most {budget} tokens."
    )
    user = "Keep this user's profile.\nINPUT:\n" + json.dumps(task, ensure_ascii=False)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_reply(text: str) -> str | None:
    """The profile text of a reply, or None for ``unchanged``; raises :class:`Refused`."""
    body = text.strip()
    fenced = _FENCE.search(body)
    if fenced:
        body = fenced.group(1).strip()
    start, end = body.find("{"), body.rfind("}")
    try:
        data = json.loads(body[start : end + 1]) if 0 <= start < end else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise Refused("the reply is not a JSON object")
    if data.get("unchanged") is True:
        return None
    profile = data.get("profile")
    if not isinstance(profile, str):
        raise Refused('the reply has neither "unchanged" nor a "profile" text')
    return profile


def lines_of(text: str, allowed: Mapping[str, int], count: Callable[[str], int]) -> list[Line]:
    """The profile's entry lines in its order, each under its heading; raises
    :class:`Refused` unless every line is an allowed entry's line (``allowed``: each
    line, and how many entries show it: no more often than that) or a fixed heading."""
    lines: list[Line] = []
    seen: Counter[str] = Counter()
    section = -1
    for raw in text.splitlines():
        item = raw.rstrip()
        if not item or _LEFT_OUT.match(item):
            continue
        header = _HEADER.match(item)
        if header:
            title = header.group("title")
            if title not in fmt.SECTIONS or fmt.SECTIONS.index(title) <= section:
                raise Refused("a heading is not one of the fixed sections, or is out of their order")
            section = fmt.SECTIONS.index(title)
            continue
        line = item + "\n"
        if line not in allowed:
            raise Refused("a line is not the line of an entry the agent may see")
        if section < 0:
            raise Refused("a line comes before any heading")
        seen[line] += 1
        if seen[line] > allowed[line]:
            raise Refused("a line is repeated")
        lines.append(Line(section, count(line), line))
    if not lines and allowed:
        raise Refused("the profile holds no entry")
    return lines


class ProfileWriter:
    """The model's side of one refresh (see the module docstring); ``run_ids`` maps
    each user to the dream run that pays for their calls."""

    def __init__(
        self,
        settings: Settings,
        run_ids: Mapping[str, int | None],
        count: Callable[[str], int],
        *,
        deadline: float | None = None,
    ) -> None:
        self.settings, self.run_ids, self.count = settings, run_ids, count
        #: ``time.monotonic()`` after which no call starts (:class:`OutOfTime`).
        self.deadline = deadline
        #: Users for whom a call was made (paid for, whatever became of its answer).
        self.paid: set[str] = set()

    def __call__(
        self, user_id: str, agent: str, built: Built, allowed: Mapping[str, int], current: Current | None
    ) -> Built | None:
        from worker import llm

        if not allowed:
            return None  # nothing to write about: the empty profile
        offered = tuple((line.section, line.text) for line in built.layout.lines)
        kept = self._unchanged(current, built, allowed, offered)
        if kept is not None:
            return kept  # what the model wrote from these very lines still holds: no call
        current_text = current.text if current is not None else built.text
        shown = [line + "\n" for line in current_text.splitlines()]
        # New or changed since the model last wrote: a line it was not offered then (where
        # that is kept), else one the current profile does not show.
        if current is not None and current.offered is not None:
            changed = {text for section, text in offered if (section, text) not in set(current.offered)}
        else:
            changed = {text for _, text in offered if text not in set(shown)}
        removed = [line for line in shown if line.startswith("- ") and line not in allowed]
        left_out = built.layout.total - len(built.layout.lines)
        messages = build_messages(
            built.budget, current_text, list(built.layout.lines), changed=changed, removed=removed, left_out=left_out
        )
        ceiling = built.budget + OUTPUT_SLACK_TOKENS + OUTPUT_TOKENS_PER_LINE * len(built.layout.lines)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise OutOfTime("the time for model work is up")
        self.paid.add(user_id)  # from here on the call may be billed, whatever it answers
        try:
            reply = llm.complete(
                self.settings,
                purpose=PURPOSE,
                messages=messages,
                max_tokens=ceiling,
                run_id=self.run_ids.get(user_id),
                agent_id=agent or None,
                response_schema=RESPONSE_SCHEMA,
            )
        except BudgetExhausted as exhausted:
            self._keep(user_id, "not_called", f"{exhausted.scope} budget exhausted")
            return None
        except llm.MalformedReply as exc:
            self._keep(user_id, "unusable", exc.reason)
            return None
        except Interrupted:
            raise  # the task's time is up: the build stops here (see tasks.profiles.compose)
        except (TransientError, PermanentError) as exc:
            self._keep(user_id, "failed", type(exc).__name__)
            return None
        try:
            text = parse_reply(reply.text)
        except Refused as exc:
            self._keep(user_id, "unusable", str(exc))
            return None
        try:
            written = self._check(current_text if text is None else text, built, allowed, offered)
        except Refused as exc:
            self._keep(user_id, "refused", str(exc))
            return None
        metrics.PROFILE_MODEL_REPLIES.labels(verdict="unchanged" if text is None else "rewritten").inc()
        return written

    def _unchanged(
        self, current: Current | None, built: Built, allowed: Mapping[str, int], offered: Offered
    ) -> Built | None:
        """The current model-written profile, kept without a call, where the model would
        be offered exactly the lines, each under its section, it wrote it from (the user's change was elsewhere:
        another agent's entry, a recall that moved no line in or out of the budget) and
        it still passes every check; else None."""
        if current is None or current.offered is None or Counter(current.offered) != Counter(offered):
            return None
        try:
            return self._check(current.text, built, allowed, offered)
        except Refused:
            return None

    def _check(self, text: str, built: Built, allowed: Mapping[str, int], offered: Offered) -> Built:
        lines = lines_of(text, allowed, self.count)
        total = sum(allowed.values())
        assembled = fmt.assemble(lines, total - len(lines))
        tokens = self.count(assembled)
        if tokens > built.budget:
            raise Refused(f"{tokens} tokens, over the budget of {built.budget}")
        layout = Layout(lines, built.layout.header_tokens, built.layout.left_out_tokens, total)
        return Built(assembled, tokens, built.budget, len(lines), total - len(lines), layout, offered)

    def _keep(self, user_id: str, verdict: str, reason: str) -> None:
        metrics.PROFILE_MODEL_REPLIES.labels(verdict=verdict).inc()
        log.info(
            "profile_model_reply_not_kept",
            user=user_ref(user_id, self.settings.log_hash_key),
            verdict=verdict,
            reason=reason[:200],
        )
