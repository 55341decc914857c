"""Structured output: the gateway asks for the form the model (or the operator) supports."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from tasks import session_end
from tasks.signals import process_pending
from tests.dream_seed import entries_of
from worker import llm, offline_model
from worker.producer import enqueue_signal
from worker.settings import Settings

PROVIDER = "reverie-capture"
SCHEMA = session_end.RESPONSE_SCHEMA


class Captured:
    def __init__(self) -> None:
        self.formats: list[Any] = []
        self.reply = "[]"


CAPTURED = Captured()


def _factory(litellm: Any) -> Any:
    from litellm.llms.custom_llm import CustomLLM

    class Capturing(CustomLLM):
        def completion(self, model: str, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            params = kwargs.get("optional_params") or {}
            CAPTURED.formats.append(params.get("response_format"))
            task = offline_model.input_of(messages)
            reply = CAPTURED.reply if CAPTURED.reply != "offline" else offline_model.answer("extract_facts", task)
            return litellm.ModelResponse(
                model=model,
                choices=[{"message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            )

    return Capturing()


def capture_settings(settings: Settings, form: str) -> Settings:
    llm.register_provider(PROVIDER, _factory)
    CAPTURED.formats.clear()
    return settings.model_copy(
        update={
            "llm_model": f"{PROVIDER}/m",
            "llm_input_cost_per_token": 1e-6,
            "llm_output_cost_per_token": 2e-6,
            "llm_response_format": form,
        }
    )


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        ("json_schema", {"type": "json_schema", "json_schema": {"name": "extract_facts", "schema": SCHEMA}}),
        ("json_object", {"type": "json_object"}),
        ("json_object_schema", {"type": "json_object", "schema": SCHEMA}),
        ("none", None),
    ],
)
def test_the_request_carries_the_response_format_the_setting_names(
    pg_settings: Settings, form: str, expected: Any
) -> None:
    settings = capture_settings(pg_settings, form)
    CAPTURED.reply = "offline"
    payload = {"conversation_id": "c", "messages": [{"role": "user", "content": "My favorite color is blue."}]}
    enqueue_signal("session_end", "ann", payload, settings=settings)
    assert process_pending(settings).processed == 1
    assert CAPTURED.formats == [expected]
    assert [(r["key"], r["value"]) for r in entries_of(settings, "ann").values()] == [("favorite_color", "blue")]


def test_auto_asks_for_a_schema_where_litellm_says_the_model_supports_one(pg_settings: Settings) -> None:
    def form(model: str) -> Any:
        settings = pg_settings.model_copy(update={"llm_model": model, "llm_response_format": "auto"})
        return llm.response_format(settings, SCHEMA, "extract_facts")

    assert form("gpt-4o-mini")["type"] == "json_schema"
    # An OpenAI-compatible endpoint litellm knows nothing about: JSON mode.
    assert form("openai/some-local-model") == {"type": "json_object"}
    # The built-in model needs neither.
    assert form("offline") is None and form("offline/drift") is None
    assert llm.response_format(pg_settings, None, "x") is None


def test_a_structured_reply_is_still_checked_in_code(pg_settings: Settings) -> None:
    settings = capture_settings(pg_settings, "json_schema")
    CAPTURED.reply = json.dumps(
        {"facts": [{"key": "home_city", "value": "Atlantis", "category": "fact", "evidence": "not said"}]}
    )
    payload = {"conversation_id": "c", "messages": [{"role": "user", "content": "I live in Porto."}]}
    enqueue_signal("session_end", "ann", payload, settings=settings)
    report = process_pending(settings)
    assert report.processed == 1 and entries_of(settings, "ann") == {}
    assert report.results[0].refused[0].outcome == "evidence: not found in any user message of this transcript"


class _Endpoint(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible chat endpoint on loopback that keeps each request body."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        task = offline_model.input_of(body["messages"])
        content = json.dumps({"facts": json.loads(offline_model.answer("extract_facts", task))})
        reply = {
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        return None


def test_an_openai_compatible_endpoint_receives_the_schema_over_http(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "not-needed-on-loopback")
    _Endpoint.bodies.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        settings = pg_settings.model_copy(
            update={
                "llm_model": "openai/local-model",
                "llm_api_base": f"http://127.0.0.1:{server.server_address[1]}/v1",
                "llm_response_format": "json_object_schema",
                "llm_input_cost_per_token": 1e-6,
                "llm_output_cost_per_token": 2e-6,
            }
        )
        payload = {"conversation_id": "c", "messages": [{"role": "user", "content": "My favorite color is blue."}]}
        enqueue_signal("session_end", "ann", payload, settings=settings)
        assert process_pending(settings).processed == 1
    finally:
        server.shutdown()
        server.server_close()
    [body] = _Endpoint.bodies
    assert body["model"] == "local-model"
    assert body["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert [(r["key"], r["value"]) for r in entries_of(settings, "ann").values()] == [("favorite_color", "blue")]
