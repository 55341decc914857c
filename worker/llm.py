"""The LLM gateway: the one module that calls litellm.

:func:`complete` prices a call before making it (prompt tokens counted by litellm x the
input price + ``max_tokens`` x the output price), reserves that much from the budgets
in :mod:`worker.budget`, makes the call outside any database transaction, then settles
the actual cost. litellm is imported on the first call, with its bundled price map,
so importing Reverie never waits on it or on the network.

Errors: :class:`BudgetExhausted` (the call was not made), :class:`TransientError`
(timeout, rate limit, 5xx, overloaded: worth trying later), :class:`PermanentError`
(authentication, unknown or unpriced model, a request the provider refuses).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from store.types import NANO
from worker import budget, metrics
from worker.errors import PermanentError, TransientError
from worker.logs import get_logger
from worker.settings import Settings

log = get_logger(__name__)

_lock = threading.Lock()
_litellm: Any = None


@dataclass(frozen=True)
class LlmReply:
    text: str
    input_tokens: int
    output_tokens: int
    cost_usd: float
    model: str


def _load() -> Any:
    """litellm, configured once per process: local price map, offline provider, quiet."""
    global _litellm  # noqa: PLW0603 - one configured import per process, on first use
    with _lock:
        if _litellm is None:
            # Without this litellm fetches its price map over the network at import.
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            import litellm

            from worker.offline_model import PROVIDER, build_handler

            litellm.suppress_debug_info = True
            litellm.telemetry = False
            providers = [p for p in (litellm.custom_provider_map or []) if p.get("provider") != PROVIDER]
            litellm.custom_provider_map = [*providers, {"provider": PROVIDER, "custom_handler": build_handler()}]
            litellm.utils.custom_llm_setup()  # type: ignore[no-untyped-call]
            _litellm = litellm
        return _litellm


def model_name(settings: Settings) -> str:
    """The litellm model string the settings name (``offline`` is the built-in model)."""
    from worker.offline_model import MODEL

    return MODEL if settings.llm_model == "offline" else settings.llm_model


def prices(settings: Settings) -> tuple[float, float]:
    """USD per input and output token: the overrides, else litellm's price map.

    Raises :class:`PermanentError` for a model litellm has no price for (a cap cannot
    be enforced on a call whose price is unknown).
    """
    from worker.offline_model import NOMINAL_INPUT_COST_PER_TOKEN, NOMINAL_OUTPUT_COST_PER_TOKEN

    given_in, given_out = settings.llm_input_cost_per_token, settings.llm_output_cost_per_token
    if settings.llm_model == "offline":
        return (
            NOMINAL_INPUT_COST_PER_TOKEN if given_in is None else given_in,
            NOMINAL_OUTPUT_COST_PER_TOKEN if given_out is None else given_out,
        )
    if given_in is not None and given_out is not None:
        return given_in, given_out
    litellm = _load()
    try:
        info = litellm.get_model_info(settings.llm_model)
    except Exception as exc:  # litellm raises bare Exception subclasses for unknown models
        raise PermanentError(
            f"model {settings.llm_model!r} has no price in litellm's map; "
            "set REVERIE_LLM_INPUT_COST_PER_TOKEN and REVERIE_LLM_OUTPUT_COST_PER_TOKEN"
        ) from exc
    in_price = given_in if given_in is not None else info.get("input_cost_per_token")
    out_price = given_out if given_out is not None else info.get("output_cost_per_token")
    if in_price is None or out_price is None:
        raise PermanentError(f"model {settings.llm_model!r} is unpriced; set REVERIE_LLM_*_COST_PER_TOKEN")
    return float(in_price), float(out_price)


def count_prompt_tokens(settings: Settings, messages: list[dict[str, str]]) -> int:
    litellm = _load()
    return int(litellm.token_counter(model=model_name(settings), messages=messages))


def classify(exc: BaseException) -> type[TransientError] | type[PermanentError] | None:
    """Which of our errors a litellm/provider exception is (None: not a provider error)."""
    litellm = _load()
    transient = (
        litellm.exceptions.Timeout,
        litellm.exceptions.RateLimitError,
        litellm.exceptions.APIConnectionError,
        litellm.exceptions.InternalServerError,
        litellm.exceptions.ServiceUnavailableError,
        litellm.exceptions.BadGatewayError,
    )
    permanent = (
        litellm.exceptions.AuthenticationError,
        litellm.exceptions.PermissionDeniedError,
        litellm.exceptions.NotFoundError,
        litellm.exceptions.BadRequestError,
        litellm.exceptions.UnprocessableEntityError,
        litellm.exceptions.ContentPolicyViolationError,
    )
    if isinstance(exc, transient):
        return TransientError
    if isinstance(exc, permanent):
        return PermanentError
    status = getattr(exc, "status_code", None)
    if isinstance(exc, litellm.exceptions.APIError) or isinstance(status, int):
        # 5xx and "overloaded" (529) come and go; other statuses will not change.
        return TransientError if isinstance(status, int) and status >= 500 else PermanentError
    return None


def complete(
    settings: Settings,
    *,
    purpose: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    run_id: int | None = None,
    agent_id: str | None = None,
) -> LlmReply:
    """One model call under the cost cap; see the module docstring for the errors."""
    litellm = _load()
    model = model_name(settings)
    label = settings.llm_model
    in_price, out_price = prices(settings)
    prompt_tokens = count_prompt_tokens(settings, messages)
    amount = budget.reservation_nano(prompt_tokens, max_tokens, in_price, out_price)
    reservation = budget.reserve(settings, budget.lines_for(settings, run_id, agent_id), amount)

    try:
        response = litellm.completion(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            timeout=settings.llm_timeout_seconds,
            num_retries=0,
        )
    except Exception as exc:
        kind = classify(exc)
        # A timed-out request may still have been billed: keep its reservation as spent.
        billed = reservation.amount_nano if isinstance(exc, litellm.exceptions.Timeout) else 0
        budget.settle(settings, reservation, billed)
        outcome = "transient" if kind is TransientError else "permanent" if kind is PermanentError else "error"
        metrics.LLM_REQUESTS.labels(model=label, outcome=outcome).inc()
        log.warning("llm_call_failed", purpose=purpose, model=label, error=type(exc).__name__, outcome=outcome)
        if kind is None:
            raise
        raise kind(f"{type(exc).__name__}: {_first_line(exc)}") from exc

    text = _reply_text(response)
    usage = getattr(response, "usage", None)
    input_tokens = int(getattr(usage, "prompt_tokens", 0) or prompt_tokens)
    output_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
    actual = budget.price_nano(input_tokens, in_price) + budget.price_nano(output_tokens, out_price)
    recorded = budget.settle(settings, reservation, actual)
    if actual > recorded:
        log.warning("llm_cost_over_reservation", purpose=purpose, model=label, over_nano=actual - recorded)

    cost = recorded / NANO
    metrics.LLM_REQUESTS.labels(model=label, outcome="ok").inc()
    metrics.LLM_TOKENS.labels(model=label, direction="input").inc(input_tokens)
    metrics.LLM_TOKENS.labels(model=label, direction="output").inc(output_tokens)
    metrics.LLM_COST.labels(model=label, purpose=purpose).inc(cost)
    return LlmReply(text=text, input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost, model=label)


def _reply_text(response: Any) -> str:
    try:
        content = response.choices[0].message.content
    except (AttributeError, IndexError):
        return ""
    return content if isinstance(content, str) else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no detail"
