"""The LLM gateway: the one module that calls litellm.

:func:`complete` prices a call before making it (prompt tokens counted by litellm x the
input price + ``max_tokens`` x the output price), reserves that much from the budgets
in :mod:`worker.budget`, makes the call outside any database transaction, then settles
the actual cost. litellm is imported on the first call, with its bundled price map,
so importing Reverie never waits on it or on the network.

When the budget left cannot pay for the whole ceiling, a caller that passes
``min_tokens`` gets the call made with the largest ceiling (at least ``min_tokens``)
the budget can still pay for; the reservation is always the price of the ceiling the
call is actually made with, so the cap holds exactly as for a full reservation.

The prompt is reserved with a margin on litellm's count where litellm does not count
with the provider's own tokenizer (:mod:`worker.token_margin`). Usage above what was
reserved for it, input or output, is logged (``llm_usage_over_reservation``) and
counted (``dream_llm_usage_over_reservation_total`` by direction; the cost the budget
did not take in ``dream_llm_unrecorded_cost_usd_total``).

A call that ends without the provider's answer (a timeout, a connection lost, the
task's soft time limit) may have been billed: its whole reservation is recorded as
spent. Only a provider's own refusal (an error status) is recorded as free.

What is recorded: the actual cost (usage x prices), never more than the reservation.
A provider that reports more output than the ceiling (or returns text far longer than
it) has broken the call's terms: its cost is recorded up to the reservation and no
further (so the cap holds; in practice the whole reservation), the overage the budget
did not take is logged (``llm_reply_over_ceiling``, ``over_nano``) and counted
(``dream_llm_requests_total`` outcome ``over_ceiling``), and the reply is not used
(:class:`MalformedReply`).

Errors: :class:`BudgetExhausted` (the call was not made), :class:`ContextWindowExceeded`
(a permanent error: the prompt is too long for the model), :class:`TransientError`
(timeout, rate limit, 5xx, overloaded: worth trying later), :class:`MalformedReply`
(a transient error: the model answered, but not with a usable reply: not JSON, cut
off at the ceiling, or over it; its cost is recorded), :class:`PermanentError`
(authentication, unknown or unpriced model, a request the provider refuses).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import Any

from store.types import NANO
from worker import budget, metrics, token_margin
from worker.errors import ContextWindowExceeded, Interrupted, PermanentError, TransientError
from worker.logs import get_logger
from worker.settings import Settings

log = get_logger(__name__)

_lock = threading.Lock()
_litellm: Any = None
#: Text longer than this many times the ceiling (in our own token count) is over it,
#: whatever usage the provider reports; the slack covers tokenizers that differ.
TEXT_OVER_CEILING_FACTOR = 2
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.DOTALL)


class MalformedReply(TransientError):
    """The provider answered, but the reply cannot be used: not JSON, cut off at the
    output ceiling, or longer than the ceiling. Its cost was recorded. Transient (a
    sampled model may answer properly next time); callers bound their attempts (a
    summary group waits for the user's next scheduled dream)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed model reply: {reason}")


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

            from worker.logging_setup import route_litellm_logging
            from worker.offline_model import PROVIDER, build_handler

            # Off the stream handler litellm installs at import (its own format, no
            # redaction, INFO and below): its records go through ours, at WARNING.
            route_litellm_logging()
            litellm.suppress_debug_info = True
            litellm.telemetry = False
            _litellm = litellm
            _install(PROVIDER, build_handler())
        return _litellm


def _install(provider: str, handler: Any) -> None:
    providers = [p for p in (_litellm.custom_provider_map or []) if p.get("provider") != provider]
    _litellm.custom_provider_map = [*providers, {"provider": provider, "custom_handler": handler}]
    _litellm.utils.custom_llm_setup()


def register_provider(provider: str, factory: Callable[[Any], Any]) -> None:
    """Plug another litellm custom provider in (models ``<provider>/...``).

    ``factory`` receives the litellm module and returns a ``litellm.CustomLLM``; it is
    how tests put a fault-injecting model behind this same gateway.
    """
    litellm = _load()
    with _lock:
        _install(provider, factory(litellm))


def is_builtin(settings: Settings) -> bool:
    """Whether the settings name the built-in model (``offline``, or its drifting mode)."""
    from worker.offline_model import BUILTIN_NAMES

    return settings.llm_model in BUILTIN_NAMES


def model_name(settings: Settings) -> str:
    """The litellm model string the settings name (``offline`` is the built-in model;
    ``offline/drift`` its drifting mode, seeded by ``REVERIE_LLM_DRIFT_SEED``)."""
    from worker.offline_model import MODEL, drift_model

    if settings.llm_model == "offline":
        return MODEL
    if is_builtin(settings):
        return drift_model(settings.llm_drift_seed)
    return settings.llm_model


def response_format(settings: Settings, schema: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The ``response_format`` a call asks for (None: the prompt alone asks for JSON).

    ``REVERIE_LLM_RESPONSE_FORMAT``: ``json_schema`` (OpenAI's structured output),
    ``json_object`` (JSON mode), ``json_object_schema`` (JSON mode carrying the schema,
    as llama.cpp's server takes it), ``none``, or ``auto``: a JSON schema where litellm
    says the model supports one, else JSON mode where it supports that, else none.
    """
    if schema is None:
        return None
    form: str = settings.llm_response_format
    if form == "auto":
        form = _auto_form(settings)
    if form == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    if form == "json_object":
        return {"type": "json_object"}
    if form == "json_object_schema":
        return {"type": "json_object", "schema": schema}
    return None


def _auto_form(settings: Settings) -> str:
    if is_builtin(settings):
        return "none"
    litellm = _load()
    model = settings.llm_model
    try:
        if litellm.supports_response_schema(model=model):
            return "json_schema"
        params = litellm.get_supported_openai_params(model=model) or []
    except Exception:  # litellm raises bare Exception subclasses for models it does not know
        return "none"
    return "json_object" if "response_format" in params else "none"


def prices(settings: Settings) -> tuple[float, float]:
    """USD per input and output token: the overrides, else litellm's price map.

    Raises :class:`PermanentError` for a model litellm has no price for (a cap cannot
    be enforced on a call whose price is unknown).
    """
    from worker.offline_model import NOMINAL_INPUT_COST_PER_TOKEN, NOMINAL_OUTPUT_COST_PER_TOKEN

    given_in, given_out = settings.llm_input_cost_per_token, settings.llm_output_cost_per_token
    if is_builtin(settings):
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


def preload(settings: Settings) -> float:
    """Import and configure litellm and load the tokenizer the configured model counts
    with; returns the seconds it took.

    The worker's main process calls this before it forks its pool, so the children
    share these pages (about 160 MB) instead of each importing a copy of its own.
    """
    started = time.monotonic()
    count_text_tokens(settings, "warm")
    return time.monotonic() - started


def count_prompt_tokens(settings: Settings, messages: list[dict[str, str]]) -> int:
    litellm = _load()
    return int(litellm.token_counter(model=model_name(settings), messages=messages))


def count_text_tokens(settings: Settings, text: str) -> int:
    """Tokens of a reply text, as the model's tokenizer (or litellm's default) counts them."""
    litellm = _load()
    return int(litellm.token_counter(model=model_name(settings), text=text, count_response_tokens=True))


def text_counter(settings: Settings) -> Callable[[str], int]:
    """A counter equal to :func:`count_text_tokens` for the configured model, with its
    tokenizer looked up once: what counts many short texts (a profile's lines) in a row.
    For the built-in model it does not import litellm (:func:`_builtin_counter`)."""
    if is_builtin(settings):
        builtin = _builtin_counter()
        if builtin is not None:
            return builtin
    litellm = _load()
    model = model_name(settings)
    if litellm.disable_token_counter is not True:
        count = _resolved_counter(model, settings)
        if count is not None:
            return count  # one function per model for the process: counts made with it can be kept
    return lambda text: count_text_tokens(settings, text)


#: litellm's counting for a model it knows no tokenizer of (the built-in model's case):
#: tiktoken's ``cl100k_base`` from the copy litellm ships, over 1,024-character chunks,
#: exact up to 4,000,000 characters. Its environment overrides send us to litellm itself.
_CL100K_FILE = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"  # tiktoken's cache name for it
_CHUNK_CHARS = 1024
_MAX_EXACT_CHARS = 4_000_000
_LITELLM_COUNT_SETTINGS = ("TIKTOKEN_ENCODE_CHUNK_SIZE_CHARS", "TOKEN_COUNTER_MAX_EXACT_CHARS")
_builtin: list[Cl100k | None] = []


def _builtin_counter() -> Cl100k | None:
    """What litellm's ``token_counter(text=..., count_response_tokens=True)`` gives for
    the built-in model, without importing litellm (seconds of a cron pass's start-up):
    the same encoding file, chunks and limit (``tests/test_token_count.py`` checks the
    two agree, so a litellm that counts otherwise fails it). None where that cannot be
    promised: a count setting of litellm's changed, or its file is not where expected."""
    with _lock:
        if _builtin:
            return _builtin[0]
        found: Cl100k | None = None
        if not any(os.environ.get(name) for name in _LITELLM_COUNT_SETTINGS):
            found = _load_cl100k()
        _builtin.append(found)
        return found


def _load_cl100k() -> Cl100k | None:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    # litellm's own choice of directory (it sets the same variable when imported).
    folder = os.environ.get("CUSTOM_TIKTOKEN_CACHE_DIR") or str(
        Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    )
    if not (Path(folder) / _CL100K_FILE).is_file():
        return None
    os.environ["TIKTOKEN_CACHE_DIR"] = folder
    import tiktoken

    return Cl100k(tiktoken.get_encoding("cl100k_base"))


class Cl100k:
    """The built-in model's count (a callable: a text's tokens), and :meth:`lines`."""

    def __init__(self, encoding: Any) -> None:
        # litellm's ``encode(text, disallowed_special=())`` allows no special token
        # either: the same tokens, without the wrapper's checks.
        self._encode = encoding.encode_ordinary
        self._encoding = encoding
        self._marks = b""
        self._slow: Any = None

    def __call__(self, text: str) -> int:
        if len(text) <= _CHUNK_CHARS:
            return len(self._encode(text))
        if len(text) > _MAX_EXACT_CHARS:
            # litellm extrapolates from samples past this length: let it.
            self._slow = self._slow or _load()
            return int(self._slow.token_counter(model=_builtin_model(), text=text, count_response_tokens=True))
        return sum(len(self._encode(text[at : at + _CHUNK_CHARS])) for at in range(0, len(text), _CHUNK_CHARS))

    def lines(self, texts: Sequence[str]) -> list[int]:
        """Each text's count, as :meth:`__call__` gives it, from one encoding of them all.

        The encoder lets other threads run while it works and then waits for its turn
        again; counted one by one, thousands of short lines beside a busy thread wait
        milliseconds each. Encoded together, each text's tokens are those up to the one
        ending with its newline: exact because cl100k's pre-tokenizer ends a piece at a
        newline followed by a non-space, or by one space and a non-space, so texts
        holding one newline, at their end, and starting with a non-space (a profile's
        lines) or with one space before one (the rest of a line after its key) are
        tokenized together as each is alone. Any other text is counted on its own, and
        should a token ever hold a newline anywhere but at its end (one straddling two
        texts), all are."""
        out = [0] * len(texts)
        whole = "".join(texts)
        if _all_join(texts, whole):
            joined: Sequence[int] = range(len(texts))
        else:
            joined = [i for i, t in enumerate(texts) if _joins(t)]
            for i in set(range(len(texts))) - set(joined):
                out[i] = self(texts[i])
            if not joined:
                return out
            whole = "".join(texts[i] for i in joined)
        # One mark per token: 1 ends with a newline (and holds no other), 2 holds one elsewhere.
        marks = bytes(map(self._newline_marks().__getitem__, self._encode(whole)))
        parts = marks.split(_ENDS_LINE)
        if len(parts) != len(joined) + 1 or parts[-1] or _HOLDS_NEWLINE in marks:
            for i in joined:
                out[i] = self(texts[i])
            return out
        counts = [len(part) + 1 for part in parts[:-1]]
        if len(joined) == len(texts):
            return counts
        for i, tokens_of in zip(joined, counts, strict=True):
            out[i] = tokens_of
        return out

    def _newline_marks(self) -> bytes:
        """Each token's mark by token id (once: 40 ms): 1 if its bytes end with the only
        newline they hold, 2 if they hold a newline elsewhere, else 0."""
        if not self._marks:
            marks = bytearray(self._encoding.max_token_value + 1)
            for token in range(len(marks)):
                try:
                    data = self._encoding.decode_single_token_bytes(token)
                except KeyError:  # an id no token has
                    continue
                if b"\n" in data:
                    marks[token] = 1 if data.index(b"\n") == len(data) - 1 else 2
            self._marks = bytes(marks)
        return self._marks


_ENDS_LINE, _HOLDS_NEWLINE = b"\x01", b"\x02"


def _joins(text: str) -> bool:
    """Whether a text is tokenized alike alone and among others (see :meth:`Cl100k.lines`)."""
    return (
        1 < len(text) <= _CHUNK_CHARS
        and text[-1] == "\n"
        and text.count("\n") == 1
        and not text[-2].isspace()
        and (not text[0].isspace() or (text[0] == " " and not text[1].isspace()))
    )


def _all_join(texts: Sequence[str], whole: str) -> bool:
    """Whether every text :func:`_joins` (``whole``: the texts joined), looked at a
    column at a time, without a call per text."""
    return (
        bool(texts)
        and min(map(len, texts)) > 1
        and max(map(len, texts)) <= _CHUNK_CHARS
        and all(map(str.endswith, texts, repeat("\n")))
        and whole.count("\n") == len(texts)
        and not any(map(str.isspace, map(_BEFORE_NEWLINE, texts)))
        # A non-space first, after one space at most.
        and not any(map(str.isspace, map(_FIRST_CHAR, map(str.removeprefix, texts, repeat(" ")))))
    )


_FIRST_CHAR, _BEFORE_NEWLINE = itemgetter(0), itemgetter(-2)


def line_counter(settings: Settings) -> Callable[[Sequence[str]], list[int]] | None:
    """Counts many lines at once (:meth:`Cl100k.lines`): the built-in model's tokenizer only."""
    found = _builtin_counter() if is_builtin(settings) else None
    return found.lines if found is not None else None


def _builtin_model() -> str:
    from worker.offline_model import MODEL

    return MODEL


#: The count function litellm resolves for a model, checked once against
#: :func:`count_text_tokens` (None: it differs, count through ``token_counter``). Loading
#: a tokenizer is costly, and a sweep builds profiles chunk after chunk.
_RESOLVED: dict[str, Callable[[str], int] | None] = {}


def _resolved_counter(model: str, settings: Settings) -> Callable[[str], int] | None:
    if model in _RESOLVED:
        return _RESOLVED[model]
    found: Callable[[str], int] | None = None
    try:
        from litellm.litellm_core_utils.token_counter import _get_count_function

        resolved = _get_count_function(model, None)
        probe = "- warm: up, 12 words\n"
        if resolved(probe) == count_text_tokens(settings, probe):

            def found(text: str) -> int:
                return int(resolved(text))

    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    _RESOLVED[model] = found
    return found


def reservation_floor_nano(settings: Settings, messages: list[dict[str, str]], min_tokens: int) -> int:
    """The least a call with these messages can reserve (its prompt and ``min_tokens``)."""
    in_price, out_price = prices(settings)
    prompt = token_margin.reserved_prompt_tokens(settings, count_prompt_tokens(settings, messages))
    return budget.reservation_nano(prompt, min_tokens, in_price, out_price)


def _refused_by_provider(litellm: Any, exc: BaseException) -> bool:
    """Whether the provider answered with an error status (it bills no tokens then);
    anything else (a timeout, a lost connection, an interruption, an answer that could
    not be read) may have been billed.

    A server error (5xx) is told apart from an answer that was not read: litellm raises
    the same ``InternalServerError`` for a ``200`` whose body is not the JSON it expects
    (a proxy's page, a body cut off), for which the provider may well have billed. Only
    an error with the HTTP error status behind it (in its chain) is taken as a refusal."""
    if isinstance(exc, litellm.exceptions.Timeout | litellm.exceptions.APIConnectionError):
        return False
    statuses = (
        litellm.exceptions.RateLimitError,
        litellm.exceptions.AuthenticationError,
        litellm.exceptions.PermissionDeniedError,
        litellm.exceptions.NotFoundError,
        litellm.exceptions.BadRequestError,
        litellm.exceptions.UnprocessableEntityError,
        litellm.exceptions.ContentPolicyViolationError,
    )
    if isinstance(exc, statuses):
        return True
    server_errors = (
        litellm.exceptions.InternalServerError,
        litellm.exceptions.ServiceUnavailableError,
        litellm.exceptions.BadGatewayError,
    )
    return isinstance(exc, server_errors) and _in_chain(exc, _http_error_statuses()) is not None


def _http_error_statuses() -> tuple[type[BaseException], ...]:
    """The error the HTTP client under litellm raises for a response with an error
    status. (Not ``openai.APIStatusError``: litellm's own errors derive from it, the
    ones raised for an answer that was not read included.)"""
    import httpx

    return (httpx.HTTPStatusError,)


def _interrupt_in(exc: BaseException) -> BaseException | None:
    """The soft time limit's interruption (Celery's ``SoftTimeLimitExceeded``) behind
    ``exc``, wherever litellm's wrapping put it in the chain; None if it holds none."""
    from billiard.exceptions import SoftTimeLimitExceeded

    return _in_chain(exc, (SoftTimeLimitExceeded,))


def _in_chain(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first error of one of ``kinds`` in ``exc``'s chain (its causes, contexts and
    litellm's ``original_exception``), ``exc`` itself included; None if there is none."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kinds):
            return current
        for linked in (current.__cause__, current.__context__, getattr(current, "original_exception", None)):
            if isinstance(linked, BaseException):
                pending.append(linked)
    return None


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
    min_tokens: int | None = None,
    run_id: int | None = None,
    agent_id: str | None = None,
    user_id: str | None = None,
    signal_id: int | None = None,
    json_reply: bool = True,
    response_schema: dict[str, Any] | None = None,
) -> LlmReply:
    """One model call under the cost cap; see the module docstring for the errors.

    ``max_tokens`` is the output ceiling; with ``min_tokens`` the call may be made with
    a smaller ceiling (never below ``min_tokens``) when the budget left cannot pay for
    the whole one. With ``json_reply`` (every Reverie prompt asks for JSON) a reply
    that holds no complete JSON value raises :class:`MalformedReply`. A signal's call
    passes ``user_id`` and ``signal_id``: it must also fit that user's day and that
    signal's own ceiling. With
    ``response_schema`` the call asks for structured output as :func:`response_format`
    decides; the reply is still checked by the caller like any other.
    """
    litellm = _load()
    model = model_name(settings)
    label = settings.llm_model
    in_price, out_price = prices(settings)
    prompt_tokens = count_prompt_tokens(settings, messages)
    reserved_prompt = token_margin.reserved_prompt_tokens(settings, prompt_tokens)
    reservation = budget.reserve_call(
        settings,
        budget.lines_for(settings, run_id, agent_id, user_id=user_id, signal_id=signal_id),
        prompt_nano=budget.price_nano(reserved_prompt, in_price),
        output_price=out_price,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
    )
    ceiling = reservation.output_tokens
    try:
        response = litellm.completion(
            model=model,
            messages=messages,
            max_tokens=ceiling,
            timeout=settings.llm_timeout_seconds,
            num_retries=0,
            **_call_options(settings, response_schema, purpose),
        )
    except Exception as exc:
        failure = _failed_call(litellm, settings, exc, reservation, purpose=purpose, label=label)
        if failure is exc:
            raise
        raise failure from exc

    text = _reply_text(response)
    usage = getattr(response, "usage", None)
    input_tokens = int(getattr(usage, "prompt_tokens", 0) or prompt_tokens)
    output_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
    if text and (output_tokens == 0 or (output_tokens <= ceiling and len(text) > ceiling)):
        # Usage is not the only witness: a reply without usage is priced by its text,
        # and text far longer than the ceiling is over it whatever usage says.
        counted = count_text_tokens(settings, text)
        if output_tokens == 0 or counted > TEXT_OVER_CEILING_FACTOR * ceiling:
            output_tokens = counted
    actual = budget.price_nano(input_tokens, in_price) + budget.price_nano(output_tokens, out_price)
    recorded = budget.settle(settings, reservation, actual)
    cost = recorded / NANO
    _report_overrun(purpose, label, (input_tokens, reserved_prompt), (output_tokens, ceiling), actual - recorded)
    metrics.LLM_TOKENS.labels(model=label, direction="input").inc(input_tokens)
    metrics.LLM_TOKENS.labels(model=label, direction="output").inc(output_tokens)
    metrics.LLM_COST.labels(model=label, purpose=purpose).inc(cost)

    problem = _problem(response, text, output_tokens, ceiling, json_reply)
    if output_tokens > ceiling:
        metrics.LLM_REQUESTS.labels(model=label, outcome="over_ceiling").inc()
        log.warning(
            "llm_reply_over_ceiling",
            purpose=purpose,
            model=label,
            ceiling=ceiling,
            output_tokens=output_tokens,
            over_nano=max(0, actual - recorded),
        )
    elif problem is not None:
        metrics.LLM_REQUESTS.labels(model=label, outcome="malformed").inc()
        log.warning("llm_reply_malformed", purpose=purpose, model=label, problem=problem)
    if problem is not None:
        raise MalformedReply(problem)
    metrics.LLM_REQUESTS.labels(model=label, outcome="ok").inc()
    return LlmReply(text=text, input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost, model=label)


def _failed_call(
    litellm: Any, settings: Settings, exc: Exception, reservation: budget.Reservation, *, purpose: str, label: str
) -> Exception:
    """Settle, count and log a call that raised; returns what :func:`complete` raises."""
    kind = classify(exc)
    interrupt = _interrupt_in(exc)
    # A request that got no answer (timed out, cut off, interrupted) may have been
    # billed: keep its reservation as spent. (litellm wraps an interruption in the call,
    # the task's soft time limit, in an error of its own, even a 5xx one.)
    refused = interrupt is None and _refused_by_provider(litellm, exc)
    recorded_nano = budget.settle(settings, reservation, 0 if refused else reservation.amount_nano)
    if recorded_nano:
        # What the budgets record, the metric records: a call that may have been billed.
        metrics.LLM_COST.labels(model=label, purpose=purpose).inc(recorded_nano / NANO)
    outcome = "transient" if kind is TransientError else "permanent" if kind is PermanentError else "error"
    metrics.LLM_REQUESTS.labels(model=label, outcome=outcome).inc()
    log.warning(
        "llm_call_failed",
        purpose=purpose,
        model=label,
        error=type(exc).__name__,
        outcome=outcome,
        recorded_nano=recorded_nano,
    )
    if interrupt is not None:
        # The task's time is up: the caller stops starting calls (a transient error to
        # any caller that does not tell it apart: the work is tried again later).
        return Interrupted(f"interrupted in the call: {type(interrupt).__name__}")
    if isinstance(exc, litellm.exceptions.ContextWindowExceededError):
        return ContextWindowExceeded(f"{type(exc).__name__}: {_first_line(exc)}")
    if kind is None:
        return exc
    return kind(f"{type(exc).__name__}: {_first_line(exc)}")


def _call_options(settings: Settings, response_schema: dict[str, Any] | None, purpose: str) -> dict[str, Any]:
    """The endpoint and the structured-output form of one call, where they apply."""
    extra: dict[str, Any] = {}
    if settings.llm_api_base:
        extra["api_base"] = settings.llm_api_base
    form = response_format(settings, response_schema, purpose)
    if form is not None:
        extra["response_format"] = form
    return extra


def _report_overrun(
    purpose: str, label: str, input_usage: tuple[int, int], output_usage: tuple[int, int], unrecorded_nano: int
) -> None:
    """Log and count usage above what the reservation took for it (used, reserved)."""
    over = [
        (direction, used, reserved)
        for direction, (used, reserved) in (("input", input_usage), ("output", output_usage))
        if used > reserved
    ]
    if unrecorded_nano > 0:
        metrics.LLM_UNRECORDED_COST.labels(model=label).inc(unrecorded_nano / NANO)
    for direction, used, reserved in over:
        metrics.LLM_USAGE_OVER_RESERVATION.labels(model=label, direction=direction).inc()
        log.warning(
            "llm_usage_over_reservation",
            purpose=purpose,
            model=label,
            direction=direction,
            used_tokens=used,
            reserved_tokens=reserved,
            unrecorded_nano=max(0, unrecorded_nano),
        )


def _problem(response: Any, text: str, output_tokens: int, ceiling: int, json_reply: bool) -> str | None:
    """Why a reply cannot be used, or None."""
    if output_tokens > ceiling:
        return f"{output_tokens} output tokens, over the ceiling of {ceiling}"
    if _finish_reason(response) == "length":
        return f"cut off at the output ceiling of {ceiling} tokens"
    if json_reply and not has_json(text):
        return "no complete JSON value in the reply" if text.strip() else "empty reply"
    return None


def has_json(text: str) -> bool:
    """Whether the text holds a complete JSON array or object: the whole text, a fenced
    block, or the span from the first bracket or brace to its last closing match (prose
    around allowed). A cut-off array whose first items are whole is not complete."""
    body = text.strip()
    fenced = _FENCE.search(body)
    if fenced:
        body = fenced.group(1).strip()
    openers = [index for index in (body.find("["), body.find("{")) if index >= 0]
    if not openers:
        return False
    start = min(openers)
    end = body.rfind("]" if body[start] == "[" else "}")
    if end <= start:
        return False
    try:
        value = json.loads(body[start : end + 1])
    except (ValueError, RecursionError):
        return False
    return isinstance(value, list | dict)


def _finish_reason(response: Any) -> str | None:
    try:
        reason = response.choices[0].finish_reason
    except (AttributeError, IndexError):
        return None
    return reason if isinstance(reason, str) else None


def _reply_text(response: Any) -> str:
    try:
        content = response.choices[0].message.content
    except (AttributeError, IndexError):
        return ""
    return content if isinstance(content, str) else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no detail"
