"""The built-in model's token count without litellm equals litellm's own count.

Profiles count every line with the configured model's tokenizer. For the built-in
model Reverie counts without importing litellm (seconds of a cron pass's start-up),
by doing what litellm does for a model it has no tokenizer of. These tests fail if
litellm ever counts otherwise (another encoding, other chunks, another limit).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import llm
from worker.offline_model import MODEL, drift_model

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

CORPUS = [
    "",
    " ",
    "\n",
    "- favorite_color: blue\n",
    "## Who the user is\n",
    "- home_city: Zürich (contradicted)\n",
    "- note: 日本語のテキストと emoji 🎉🎉 mixed\n",
    "   leading and trailing   \n\n\n",
    "<|endoftext|> is plain text here",
    "x" * 1023,
    "x" * 1024,
    "x" * 1025,
    "word " * 700,
    ("- key_%d: value with some words %d\n" * 1) * 3,
    "".join(f"- line_{i}: {'long value ' * (i % 17)}\n" for i in range(400)),
    "ab" * 1024 + " tail",
    "é" * 3000,
    "\u00a0\u2028\u2029\t\r\n mixed whitespace",
]


def litellm_count(model: str, text: str) -> int:
    import litellm

    return int(litellm.token_counter(model=model, text=text, count_response_tokens=True))


@pytest.fixture(scope="module")
def count() -> llm.Callable[[str], int]:
    found = llm._builtin_counter()
    assert found is not None, "the built-in model's counter could not load litellm's cl100k_base file"
    return found


@pytest.mark.parametrize("model", [MODEL, drift_model(7)])
def test_the_count_without_litellm_is_litellms_count(count: llm.Callable[[str], int], model: str) -> None:
    for text in CORPUS:
        assert count(text) == litellm_count(model, text), text[:60]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=3000))
def test_any_text_counts_the_same(text: str) -> None:
    found = llm._builtin_counter()
    assert found is not None
    assert found(text) == litellm_count(MODEL, text)


def test_counting_for_the_built_in_model_does_not_import_litellm() -> None:
    code = (
        "import sys\n"
        "from worker import llm\n"
        "from worker.settings import Settings\n"
        "count = llm.text_counter(Settings(_env_file=None, llm_model='offline', database_url='sqlite://'))\n"
        "print(count('- favorite_color: blue\\n'), 'litellm' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == [str(litellm_count(MODEL, "- favorite_color: blue\n")), "False"]


def test_a_changed_litellm_count_setting_sends_counting_to_litellm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_ENCODE_CHUNK_SIZE_CHARS", "512")
    monkeypatch.setattr(llm, "_builtin", [])
    assert llm._builtin_counter() is None


_line_texts = st.lists(
    st.one_of(
        # A profile's lines: a non-space first, a newline last.
        st.builds(lambda k, v: f"- {k}: {v}".rstrip() + "\n", st.text(max_size=40), st.text(max_size=120)),
        st.sampled_from(["## Preferences\n", "(3 more entries left out)\n", "- x: 12345\n", "- y: ...\n"]),
        # Anything else is counted on its own, and must come out the same.
        st.text(max_size=60),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_line_texts)
def test_lines_counted_together_count_as_each_alone(texts: list[str]) -> None:
    found = llm._builtin_counter()
    assert found is not None
    assert found.lines(texts) == [found(t) for t in texts]
    # ... and as litellm counts each (spot check: one of them).
    if texts:
        assert found.lines(texts)[-1] == litellm_count(MODEL, texts[-1])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.builds(lambda k, v: f"- {k}: {v}".rstrip() + "\n", st.text(max_size=40), st.text(max_size=120)),
        min_size=1,
        max_size=80,
    )
)
def test_a_profiles_lines_alone_count_as_each_alone(texts: list[str]) -> None:
    # Every text a profile line: they are looked at all at once, not one by one.
    found = llm._builtin_counter()
    assert found is not None
    assert found.lines(texts) == [found(t) for t in texts]


def test_lines_that_would_join_are_counted_alone() -> None:
    found = llm._builtin_counter()
    assert found is not None
    # Texts ending in a space, or starting with one, are tokenized with their
    # neighbours otherwise than alone: they never share an encoding.
    texts = ["- a: b \n", " - c\n", "word", "  \n", "- d: e\n", "\t- f\n", " \tg\n", "  h\n", " \n"]
    assert found.lines(texts) == [found(t) for t in texts]


def test_every_character_on_either_side_of_a_join_counts_as_alone() -> None:
    """Lines are counted from one encoding of them all: exact only while the tokenizer
    ends a piece at a line's end whatever character comes before or after it. Every
    character that is no space (a stride over the astral planes) is put at both ends
    of a line, beside the same on its neighbours."""
    found = llm._builtin_counter()
    assert found is not None
    chars = [chr(i) for i in [*range(0x10000), *range(0x10000, 0x110000, 97)] if not chr(i).isspace()]
    chars = [c for c in chars if not 0xD800 <= ord(c) <= 0xDFFF]  # lone surrogates are no text
    texts = [f"{c}- {c}'s {c}{c}\n" for c in chars]
    assert found.lines(texts) == [found(t) for t in texts]
    # The rest of a line after its key: one space first.
    texts = [f" {c}{c} {c}'s {c}\n" for c in chars]
    assert found.lines(texts) == [found(t) for t in texts]
