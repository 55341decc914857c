"""How many prompt tokens a reservation adds to litellm's count, per provider family.

litellm counts a prompt with the provider's own tokenizer only for OpenAI's models
(and a few it can download); for every other family it counts with OpenAI's, and the
provider bills what its own tokenizer counts, which can be a third more for the same
text. A reservation that covers the prompt as counted would let such a call cost more
than it reserved, so the prompt is reserved with a margin for the family: small where
the count is (nearly) the provider's own, more the further its tokenizer is from it.
``REVERIE_LLM_PROMPT_TOKEN_MARGIN`` replaces the family's margin.
"""

from __future__ import annotations

import math

from worker.settings import Settings

#: (family, its margin) for the model-name prefixes litellm uses, checked in order.
FAMILIES: tuple[tuple[str, tuple[str, ...], float], ...] = (
    ("offline", ("offline",), 0.0),
    # litellm counts with cl100k; gpt-4o and the o-series bill by o200k, which for the
    # same text counts about as many tokens or fewer: a small margin covers the rest.
    ("openai", ("openai/", "azure/", "gpt-", "chatgpt-", "o1", "o3", "o4", "text-completion-openai/"), 0.05),
    ("anthropic", ("anthropic/", "claude", "bedrock/anthropic.", "vertex_ai/claude"), 0.40),
    ("gemini", ("gemini/", "gemini-", "vertex_ai/gemini", "vertex_ai/"), 0.25),
)
#: Any other family (Mistral, Llama, Cohere, custom providers...): counted with a
#: tokenizer that is not theirs, by an amount Reverie cannot know.
OTHER_MARGIN = 0.50


def family(model: str) -> str:
    """The provider family of a litellm model string (``other`` when not known)."""
    name = model.lower()
    for label, prefixes, _margin in FAMILIES:
        if name.startswith(prefixes):
            return label
    return "other"


def margin(settings: Settings) -> float:
    """The fraction of the counted prompt reserved on top of it."""
    if settings.llm_prompt_token_margin is not None:
        return settings.llm_prompt_token_margin
    label = family(settings.llm_model)
    return next((value for name, _prefixes, value in FAMILIES if name == label), OTHER_MARGIN)


def reserved_prompt_tokens(settings: Settings, counted: int) -> int:
    """The prompt tokens a call reserves: litellm's count plus the family's margin."""
    return math.ceil(counted * (1 + margin(settings)) - 1e-9)
