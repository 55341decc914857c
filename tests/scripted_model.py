"""A model behind the real LLM gateway that answers what a test scripts (priced, its
tokens counted as litellm counts them), and writes every profile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker import llm
from worker.settings import Settings

SCRIPTED = "reverie-profile-script"
#: What the model answers.
SCRIPTED_REPLY: dict[str, str] = {"text": ""}
#: The last message of each prompt it was sent, in order.
CALLS: list[str] = []
#: Run (and dropped) after the next call, one each.
AFTER_CALL: list[Callable[[], None]] = []


def scripted_settings(settings: Settings) -> Settings:
    """``settings`` with the scripted model, priced, writing every profile."""

    def factory(litellm: Any) -> Any:
        class Scripted(litellm.CustomLLM):  # type: ignore[misc]
            def completion(self, model: str, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
                CALLS.append(str(messages[-1]["content"]))
                if AFTER_CALL:
                    AFTER_CALL.pop(0)()
                text = SCRIPTED_REPLY["text"]
                prompt = int(litellm.token_counter(model="gpt-4o", messages=messages))
                output = int(litellm.token_counter(model="gpt-4o", text=text, count_response_tokens=True))
                return litellm.ModelResponse(
                    model=model,
                    choices=[{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    usage={"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
                )

        return Scripted()

    llm.register_provider(SCRIPTED, factory)
    return settings.model_copy(
        update={
            "llm_model": f"{SCRIPTED}/m",
            "llm_input_cost_per_token": 1e-6,
            "llm_output_cost_per_token": 2e-6,
            "profile_writer": "model",
        }
    )
