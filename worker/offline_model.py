"""The deterministic built-in model, plugged into litellm as a custom provider.

``REVERIE_LLM_MODEL=offline`` routes through the same gateway code as a real model
(token counting, reservation, the litellm call, usage, settlement); only the answer is
computed here. Prompt convention: the system prompt starts with ``[reverie:<purpose>]``
and the last user message carries the task input as JSON after a line ``INPUT:``.
The reply is a JSON array of items (for ``profile``, an object: see :func:`profile`).

Importing this module does not import litellm; :func:`build_handler` does.
"""

from __future__ import annotations

import json
import re
from typing import Any

PROVIDER = "reverie-offline"
MODEL = f"{PROVIDER}/offline"
#: ``REVERIE_LLM_MODEL`` values that name the built-in model (and its drifting mode).
BUILTIN_NAMES = ("offline", "offline/drift")
_DRIFT = "drift-"
# Nominal prices (USD per token) used when REVERIE_LLM_*_COST_PER_TOKEN are unset:
# the order of magnitude of a small hosted model, so caps bite as they would for real.
NOMINAL_INPUT_COST_PER_TOKEN = 1e-6
NOMINAL_OUTPUT_COST_PER_TOKEN = 2e-6

_TAG = re.compile(r"^\[reverie:([a-z_]+)\]")


def purpose_of(messages: list[dict[str, Any]]) -> str:
    """The purpose named by the system prompt's tag line ('' when there is none)."""
    for message in messages:
        if message.get("role") == "system":
            match = _TAG.match(str(message.get("content", "")))
            return match.group(1) if match else ""
    return ""


def input_of(messages: list[dict[str, Any]]) -> Any:
    """The JSON after the ``INPUT:`` line of the last user message (None if absent)."""
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = str(message.get("content", ""))
        marker = content.rfind("INPUT:")
        if marker < 0:
            return None
        try:
            return json.loads(content[marker + len("INPUT:") :])
        except ValueError:
            return None
    return None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def summarize(task: dict[str, Any]) -> list[dict[str, Any]]:
    """Fold the entries, in order, into ``target`` items of ``key: value; ...`` text."""
    entries = [e for e in task.get("entries", []) if isinstance(e, dict)]
    target = max(1, int(task.get("target", 1)))
    if not entries:
        return []
    stem = f"{task.get('category') or 'fact'}_summary"
    chunks = min(target, len(entries))
    size = -(-len(entries) // chunks)
    items = []
    for index in range(chunks):
        part = entries[index * size : (index + 1) * size]
        if not part:
            break
        value = "; ".join(f"{e.get('key')}: {_text(e.get('value'))}" for e in part)
        key = stem if chunks == 1 else f"{stem}_{index + 1}"
        items.append({"key": key, "value": value})
    return items


def profile_lines(task: dict[str, Any]) -> list[tuple[str, str]]:
    """The profile a model would write: the given lines under their sections, new or
    changed ones first within each section, the others in the order given."""
    entries = [e for e in task.get("entries", []) if isinstance(e, dict) and isinstance(e.get("line"), str)]
    order = {name: index for index, name in enumerate(task.get("sections") or [])}
    ranked = sorted(entries, key=lambda e: (order.get(e.get("section"), len(order)), not e.get("changed")))
    return [(str(e.get("section")), str(e["line"])) for e in ranked]


def profile_text(lines: list[tuple[str, str]]) -> str:
    parts: list[str] = []
    for index, (section, line) in enumerate(lines):
        if not index or lines[index - 1][0] != section:
            parts.append(f"## {section}")
        parts.append(line)
    return "\n".join(parts) + "\n" if parts else ""


def profile(task: dict[str, Any]) -> dict[str, Any]:
    """``unchanged`` when no entry is new or changed and no line went away, else the
    given lines reordered (see :func:`profile_lines`)."""
    entries = [e for e in task.get("entries", []) if isinstance(e, dict)]
    if not task.get("removed") and not any(e.get("changed") for e in entries):
        return {"unchanged": True}
    return {"profile": profile_text(profile_lines(task))}


def answer(purpose: str, task: Any) -> str:
    """The reply text for a purpose and its input."""
    if not isinstance(task, dict):
        return "[]"
    if purpose == "profile":
        return json.dumps(profile(task), ensure_ascii=False)
    if purpose == "summarize":
        items = summarize(task)
    elif purpose == "extract_facts":
        from worker import offline_rules

        items = offline_rules.extract_facts(task)
    elif purpose == "feedback":
        from worker import offline_rules

        items = offline_rules.feedback_candidates(task)
    else:
        items = []
    return json.dumps(items, ensure_ascii=False)


def drift_model(seed: int) -> str:
    """The litellm model string of the drifting mode with this seed."""
    return f"{PROVIDER}/{_DRIFT}{seed}"


def drift_seed(model: str) -> int | None:
    """The seed a drifting-mode model string carries (None: the plain built-in model)."""
    name = model.rsplit("/", 1)[-1]
    if not name.startswith(_DRIFT):
        return None
    try:
        return int(name[len(_DRIFT) :])
    except ValueError:
        return None


def build_handler() -> Any:
    """A litellm ``CustomLLM`` instance that answers with :func:`answer`."""
    import litellm
    from litellm.llms.custom_llm import CustomLLM

    class OfflineModel(CustomLLM):
        def completion(self, model: str, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            params = kwargs.get("optional_params") or {}
            max_tokens = int(params.get("max_tokens") or 1024)
            # A module-level lookup at call time, so tests can script replies and failures.
            seed = drift_seed(model)
            if seed is None:
                text = answer(purpose_of(messages), input_of(messages))
            else:
                from worker import offline_drift

                text = offline_drift.answer(purpose_of(messages), input_of(messages), seed)
            prompt_tokens = litellm.token_counter(model=MODEL, messages=messages)
            completion_tokens = litellm.token_counter(model=MODEL, text=text, count_response_tokens=True)
            finish_reason = "stop"
            if completion_tokens > max_tokens:
                # Like a real model: the reply stops at the output ceiling, and says so.
                text = text[: max(1, len(text) * max_tokens // completion_tokens - 1)]
                completion_tokens = min(
                    max_tokens, litellm.token_counter(model=MODEL, text=text, count_response_tokens=True)
                )
                finish_reason = "length"
            return litellm.ModelResponse(
                model=model,
                choices=[{"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
                usage={
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            )

    return OfflineModel()
