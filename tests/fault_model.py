"""A fault-injecting model behind the real LLM gateway (no network).

It is a litellm custom provider, ``reverie-faults``, plugged in the same way as the
offline model (:func:`worker.llm.register_provider`), so every call goes through the
gateway's real path: token counting, reservation, ``litellm.completion``, usage,
settlement, error classification. Select it with :func:`settings_for`; script it with
:data:`SCRIPT`: each call takes the next fault of ``SCRIPT.plan``, then ``SCRIPT.then``.
A healthy call answers what the offline model would.

Faults: ``timeout``, ``rate_limit`` (429), ``server_error`` (500), ``overloaded`` (503),
``auth`` (401, permanent), ``malformed`` (prose, no JSON), ``truncated`` (JSON cut two
thirds in, the provider still says ``stop``), ``cut_off`` (cut at the ceiling, ``length``),
``over_usage`` (a proper reply whose usage reports ten times the ceiling), ``long_text``
(text dozens of times the ceiling while usage claims to be within it).

Calls that end without an answer: ``disconnect`` (the connection drops after the
request went out), ``interrupted`` (the task's soft time limit fires in the call) and
``hang`` (the call never returns: a process to kill mid-call). ``Script.overbill``
makes every reply bill that fraction more prompt tokens than litellm counts (a provider
whose tokenizer is not OpenAI's); ``Script.context_limit`` refuses every prompt longer
than that many tokens with litellm's context-window error.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from worker import llm, offline_model
from worker.settings import Settings

PROVIDER = "reverie-faults"
MODEL = f"{PROVIDER}/scripted"
INPUT_PRICE = 1e-6
OUTPUT_PRICE = 2e-6
TRANSIENT = ("timeout", "rate_limit", "server_error", "overloaded")
MALFORMED = ("malformed", "truncated", "cut_off", "over_usage", "long_text")
FAULTS = (*TRANSIENT, "auth", *MALFORMED)
UNANSWERED = ("disconnect", "interrupted")


@dataclass
class Script:
    """What the next calls do, and what the calls were."""

    plan: list[str] = field(default_factory=list)
    then: str = "ok"
    calls: int = 0
    ceilings: list[int] = field(default_factory=list)
    overbill: float = 0.0
    context_limit: int | None = None
    #: Prompt tokens of each call as litellm counts them (before any overbilling).
    prompts: list[int] = field(default_factory=list)
    #: Called when a ``hang`` call is entered (a test kills the process then).
    on_hang: Callable[[], Any] | None = None

    def reset(self, *plan: str, then: str = "ok", overbill: float = 0.0, context_limit: int | None = None) -> None:
        self.plan, self.then, self.calls, self.ceilings = list(plan), then, 0, []
        self.overbill, self.context_limit, self.prompts = overbill, context_limit, []

    def next(self, max_tokens: int) -> str:
        self.calls += 1
        self.ceilings.append(max_tokens)
        return self.plan.pop(0) if self.plan else self.then


SCRIPT = Script()


def settings_for(settings: Settings, **overrides: Any) -> Settings:
    """``settings`` with the fault model selected (and priced: litellm has no price for it)."""
    install()
    update = {"llm_model": MODEL, "llm_input_cost_per_token": INPUT_PRICE, "llm_output_cost_per_token": OUTPUT_PRICE}
    return settings.model_copy(update={**update, **overrides})


def install() -> None:
    llm.register_provider(PROVIDER, _build)


def _error(litellm: Any, fault: str) -> Exception:
    names = {
        "timeout": "Timeout",
        "rate_limit": "RateLimitError",
        "server_error": "InternalServerError",
        "overloaded": "ServiceUnavailableError",
        "auth": "AuthenticationError",
    }
    cls = getattr(litellm.exceptions, names[fault])
    error: Exception = cls(message=f"scripted {fault}", llm_provider=PROVIDER, model=MODEL)
    if fault in ("server_error", "overloaded"):
        # As litellm raises it for a response with that status: from the HTTP client's
        # error (a server error without one is an answer that was not read).
        import httpx

        status = 500 if fault == "server_error" else 503
        request = httpx.Request("POST", "http://fault.invalid/v1/chat/completions")
        error.__cause__ = httpx.HTTPStatusError(
            f"scripted {fault}", request=request, response=httpx.Response(status, request=request)
        )
    return error


def _reply(fault: str, healthy: str, max_tokens: int, count: Any) -> tuple[str, int, str]:
    """Text, reported output tokens and finish reason for a non-raising fault."""
    if fault == "malformed":
        return "Sure! Here is what I found: the user likes blue. Anything else?", 16, "stop"
    if fault == "truncated":
        # Two thirds in: the first items of an array are whole, the array is not.
        text = healthy[: max(1, len(healthy) * 2 // 3)]
        return text, count(text), "stop"
    if fault == "cut_off":
        text = healthy[: max(1, min(len(healthy) // 2, max_tokens))]
        return text, min(max_tokens, count(text)), "length"
    if fault == "over_usage":
        return healthy, 10 * max_tokens, "stop"
    if fault == "long_text":
        text = json.dumps([{"key": "runaway", "value": "word " * (40 * max_tokens)}])
        return text, max_tokens, "stop"
    return healthy, count(healthy), "stop"


def _unanswered(litellm: Any, fault: str) -> Exception:
    if fault == "hang":
        if SCRIPT.on_hang is not None:
            SCRIPT.on_hang()
        time.sleep(3600)
    if fault == "interrupted":
        from celery.exceptions import SoftTimeLimitExceeded

        return SoftTimeLimitExceeded()
    error: Exception = litellm.exceptions.APIConnectionError(
        message="scripted disconnect: connection reset after the request was sent", llm_provider=PROVIDER, model=MODEL
    )
    return error


def _build(litellm: Any) -> Any:
    class FaultModel(litellm.CustomLLM):  # type: ignore[misc]
        def completion(self, model: str, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            max_tokens = int((kwargs.get("optional_params") or {}).get("max_tokens") or 1024)
            counted = int(litellm.token_counter(model=MODEL, messages=messages))
            SCRIPT.prompts.append(counted)
            fault = SCRIPT.next(max_tokens)
            if fault in (*TRANSIENT, "auth"):
                raise _error(litellm, fault)
            if fault in (*UNANSWERED, "hang"):
                raise _unanswered(litellm, fault)
            if SCRIPT.context_limit is not None and counted > SCRIPT.context_limit:
                raise litellm.exceptions.ContextWindowExceededError(
                    message=f"scripted: {counted} prompt tokens, over the context window of {SCRIPT.context_limit}",
                    model=MODEL,
                    llm_provider=PROVIDER,
                )
            healthy = offline_model.answer(offline_model.purpose_of(messages), offline_model.input_of(messages))

            def count(text: str) -> int:
                return int(litellm.token_counter(model=MODEL, text=text, count_response_tokens=True))

            text, output_tokens, finish = _reply(fault, healthy, max_tokens, count)
            prompt_tokens = math.ceil(counted * (1 + SCRIPT.overbill))
            return litellm.ModelResponse(
                model=model,
                choices=[{"message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                usage={
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": output_tokens,
                    "total_tokens": prompt_tokens + output_tokens,
                },
            )

    return FaultModel()
