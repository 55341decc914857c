"""Key matching: the rules form, the contrast-word veto, and the matcher's answers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select, text
from structlog.testing import capture_logs

from store import key_vectors
from store.db import session_scope
from tests.key_pairs import DIFFERENT, SAME
from tests.key_similarities import SIMILARITY
from worker.keymatch import KeyMatcher, forget_matchers, get_matcher, rules
from worker.keymatch.embedding import TOKENIZER_PATH, default_model_path
from worker.keymatch.lookup import look_up_first
from worker.settings import Settings


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("favorite_color", "Favourite-Colours"),
        ("favorite_color", "favoriteColor"),
        ("favorite_color", "fav colour"),
        ("date_of_birth", "DOB"),
        ("timezone", "time_zone"),
        ("timezone", "TZ"),
        ("hobby", "Hobbies"),
        ("phone_number", "mobile no"),
        ("neighborhood", "neighbourhoods"),
        ("last_name", "surname"),
    ],
)
def test_rules_make_one_key_of_case_separators_spelling_plurals_and_abbreviations(a: str, b: str) -> None:
    assert rules.normalise(a) == rules.normalise(b)
    matcher = KeyMatcher(mode="rules")
    assert matcher.same(a, b)
    assert matcher.find(b, ["unrelated", a]) == a


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("first_name", "last_name"),
        ("home_city", "work_city"),
        ("dog_name", "cat_name"),
        ("start_date", "end_date"),
        ("min_temperature", "max_temperature"),
        ("previous_employer", "current_employer"),
        ("favorite_food", "least_favorite_food"),
        ("phone_1", "phone_2"),
        ("n0", "n1"),
        ("small_note_0", "big_note_0"),
        ("note_0_1", "note_1_0"),
        ("a0", "b0"),
        ("x", "y"),
        ("short_term_goal", "long_term_goal"),
        ("note1", "note2"),
        ("address_line", "address_line2"),
        ("mother_name", "father_name"),
        ("hobby_one", "hobby_two"),
        ("child_one_name", "child_two_name"),
        ("address_line_one", "address_line_two"),
        ("first_pet", "second_pet"),
    ],
)
def test_keys_that_differ_in_a_contrasting_word_never_match(a: str, b: str) -> None:
    assert rules.contrasting(a, b)
    assert not KeyMatcher(mode="rules").same(a, b)


def test_keys_that_only_share_words_are_not_vetoed() -> None:
    assert not rules.contrasting("home_city", "city")
    assert not rules.contrasting("birthday", "date_of_birth")
    assert not rules.contrasting("favorite_color", "favourite_colour")


def test_find_prefers_the_identical_key_and_answers_none_without_a_match() -> None:
    matcher = KeyMatcher(mode="rules")
    assert matcher.find("Favorite_Color", ["favorite_color", "Favorite_Color"]) == "Favorite_Color"
    assert matcher.find("shoe_size", ["favorite_color", "home_city"]) is None
    assert matcher.find("anything", []) is None


def test_groups_pick_one_representative_whatever_the_order() -> None:
    matcher = KeyMatcher(mode="rules")
    keys = ["Favourite-Colour", "favorite_color", "first_name", "last_name", "FavoriteColors"]
    forward = matcher.groups(keys)
    backward = matcher.groups(list(reversed(keys)))
    assert forward == backward
    assert len({forward[k] for k in ("Favourite-Colour", "favorite_color", "FavoriteColors")}) == 1
    assert forward["first_name"] == "first_name"
    assert forward["last_name"] == "last_name"


def test_rules_form_is_stable_when_applied_again() -> None:
    for key in [*rules._ABBREVIATIONS, *rules._SPELLING, "zip_code", "Favourite-Colours", "phone_no"]:
        assert rules.normalise(rules.normalise(key)) == rules.normalise(key), key


def test_off_compares_case_and_separators_only() -> None:
    matcher = KeyMatcher(mode="off")
    assert matcher.same("Favorite-Color", "favorite_color")
    assert not matcher.same("favorite_color", "favourite_colour")
    assert not matcher.same("dob", "date_of_birth")


# -- with the local model ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_matcher() -> KeyMatcher:
    forget_matchers()
    matcher = get_matcher(Settings(key_matching="embedding"))
    assert matcher.embedder is not None, "the key-matching model did not load"
    return matcher


def _scores(matcher: KeyMatcher) -> tuple[int, int, int]:
    """(true positives, false positives, false negatives) over the labelled pairs."""
    tp = sum(matcher.same(a, b) for a, b in SAME)
    fp = sum(matcher.same(a, b) for a, b in DIFFERENT)
    return tp, fp, len(SAME) - tp


def test_labelled_pairs_precision_is_total_and_recall_at_least_90_percent(model_matcher: KeyMatcher) -> None:
    tp, fp, fn = _scores(model_matcher)
    wrong = [pair for pair in DIFFERENT if model_matcher.same(*pair)]
    assert fp == 0, f"keys that are different facts were matched: {wrong}"
    assert tp / (tp + fn) >= 0.90, f"recall {tp}/{tp + fn}"


@pytest.mark.parametrize(
    ("a", "b"),
    [("hobby_one", "hobby_two"), ("child_one_name", "child_two_name"), ("address_line_one", "address_line_two")],
)
def test_numbered_keys_spelled_out_are_two_facts_for_the_model_too(model_matcher: KeyMatcher, a: str, b: str) -> None:
    """Joined as one key, keep_newest removed one of the two (a fact of its own)."""
    assert not model_matcher.same(a, b)
    assert model_matcher.find(b, [a]) is None


@pytest.mark.parametrize(("a", "b"), [("big", "long"), ("wide", "narrow"), ("box_width", "box_depth")])
def test_sizes_of_two_dimensions_are_two_facts_for_the_model_too(model_matcher: KeyMatcher, a: str, b: str) -> None:
    """The model put ``big`` and ``long`` (and ``wide`` and ``narrow``) together: two
    rows marked contradicted, and under keep_newest one of them removed."""
    assert not model_matcher.same(a, b)
    assert model_matcher.same("big", "large")  # one side of the class: one fact


def test_rules_alone_miss_what_the_model_finds(model_matcher: KeyMatcher) -> None:
    rules_only = KeyMatcher(mode="rules")
    rules_tp, rules_fp, _ = _scores(rules_only)
    model_tp, _, _ = _scores(model_matcher)
    assert rules_fp == 0
    assert rules_tp < model_tp
    assert not rules_only.same("diet", "dietary_preference")
    assert model_matcher.same("diet", "dietary_preference")


def test_find_returns_the_existing_key_that_means_the_proposed_one(model_matcher: KeyMatcher) -> None:
    existing = ["first_name", "date_of_birth", "city_of_residence", "work_city", "favorite_food"]
    assert model_matcher.find("birthday", existing) == "date_of_birth"
    assert model_matcher.find("home_city", existing) == "city_of_residence"
    assert model_matcher.find("last_name", existing) is None
    assert model_matcher.find("favorite_book", existing) is None


def test_groups_never_chain_contrasting_keys_through_a_common_neighbour(model_matcher: KeyMatcher) -> None:
    keys = ["name", "first_name", "last_name", "birthday", "date_of_birth", "DOB", "home_city", "work_city"]
    groups = model_matcher.groups(keys)
    assert groups["first_name"] != groups["last_name"]
    assert groups["home_city"] != groups["work_city"]
    assert groups["birthday"] == groups["date_of_birth"] == groups["DOB"]
    assert groups == model_matcher.groups(list(reversed(keys)))


def test_similarities_are_those_the_thresholds_were_calibrated_on() -> None:
    # However the model is run, the same pair must score as it did when the thresholds
    # were chosen: a shifted score would silently move every match decision. The
    # lexicon's synonyms are left out here: they rewrite some keys before the model sees
    # them, which is the lexicon's business, not the model's.
    forget_matchers()
    matcher = get_matcher(Settings(key_matching="embedding", key_lexicon=False))
    assert matcher.embedder is not None, "the key-matching model did not load"
    shifted = {
        pair: (round(got, 6), expected)
        for pair, expected in SIMILARITY.items()
        if abs((got := matcher.similarity(*pair) or 0.0) - expected) > 1e-4
    }
    forget_matchers()
    assert shifted == {}


def _outputs(model: bytes, phrases: list[str]) -> object:
    import numpy as np
    import onnxruntime
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encoded = tokenizer.encode_batch(phrases)
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})[0]


def test_looking_embedding_tables_up_before_scaling_gives_the_same_numbers_bit_for_bit() -> None:
    import numpy as np

    path = default_model_path()
    assert path is not None
    original = path.read_bytes()
    rewritten, tables = look_up_first(original)
    # The word and the position tables; the token-type table is float32 in the file.
    assert tables == 2
    assert rewritten != original
    phrases = ["the user's home city", "the user's favourite colour of all colours", "x", "the user's dob"]
    assert np.array_equal(_outputs(original, phrases), _outputs(rewritten, phrases))
    # A graph with nothing left to rewrite comes back as it was.
    again, more = look_up_first(rewritten)
    assert more == 0 and again is rewritten


_FORK_SCRIPT = """
import json, os, sys
import numpy as np
from worker.keymatch.embedding import Embedder

def memory(pid="self"):
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith("Private_Dirty:"):
            out["Private_Dirty"] = int(line.split()[1]) / 1024
    return out

words = ("home", "work", "favourite", "first", "pet")
phrases = [f"the user's {w} {k}" for w in words for k in ("city", "name", "book", "colour")]
embedder = Embedder()
assert getattr(embedder._session, "_model_bytes", None) is None, "the session keeps the model's bytes"
parent = embedder.embed(phrases)
children = []
for _ in range(2):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        at_fork = memory()
        vectors = [embedder.embed(phrases[i : i + 4]) for i in range(0, len(phrases), 4)]
        vectors += [embedder.embed([p]) for p in phrases]
        done = memory()
        report = {
            "batched": np.concatenate(vectors[:5]).tolist(),
            "single": np.concatenate(vectors[5:]).tolist(),
            "peak_growth": done["VmHWM"] - at_fork["VmRSS"],
            "dirty_growth": done["Private_Dirty"] - at_fork["Private_Dirty"],
        }
        with os.fdopen(write, "w") as out:
            json.dump(report, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        children.append(json.load(got))
    os.waitpid(pid, 0)
print(json.dumps({"parent": parent.tolist(), "children": children}))
"""


def test_forked_children_get_the_parents_vectors_and_their_runs_stay_small(tmp_path: Path) -> None:
    # As in the worker: the embedder is built in the first process, then the pool forks;
    # each child runs the model (one thread, no pool to lose in the fork) and gets the
    # parent's vectors. A run must not cost a child the word table in float32 (about
    # 90 MB at its peak) nor leave its freed buffers behind as private memory.
    import numpy as np

    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    parent = np.array(found["parent"], dtype=np.float32)
    assert len(found["children"]) == 2
    for child in found["children"]:
        assert np.abs(np.array(child["batched"], dtype=np.float32) - parent).max() <= 1e-6
        assert np.abs(np.array(child["single"], dtype=np.float32) - parent).max() <= 1e-6
        assert child["peak_growth"] < 40, child["peak_growth"]
        assert child["dirty_growth"] < 12, child["dirty_growth"]


# -- when the model cannot be used ---------------------------------------------------


def _fallback_count(reason: str) -> float:
    value = REGISTRY.get_sample_value("dream_key_model_unavailable_total", {"reason": reason})
    return value or 0.0


@pytest.mark.parametrize("damage", ["missing", "checksum"])
def test_missing_or_damaged_model_file_leaves_the_rules_with_a_warning_and_a_count(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.onnx"
    if damage == "checksum":
        original = default_model_path()
        assert original is not None
        data = bytearray(original.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    forget_matchers()
    before = _fallback_count(damage)
    settings = Settings(key_matching="embedding", key_matching_model_path=str(path))
    with capture_logs() as logs:
        matcher = get_matcher(settings)
        again = get_matcher(settings)
    assert again is matcher
    assert matcher.embedder is None
    assert _fallback_count(damage) == before + 1
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["reason"] == damage
    assert matcher.same("Favourite-Colour", "favorite_color")
    assert not matcher.same("diet", "dietary_preference")
    assert matcher.groups(["first_name", "last_name"]) == {"first_name": "first_name", "last_name": "last_name"}
    forget_matchers()


def test_missing_onnxruntime_leaves_the_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes ``import onnxruntime`` raise ImportError, as on a host without it.
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    forget_matchers()
    before = _fallback_count("runtime")
    matcher = get_matcher(Settings(key_matching="embedding"))
    assert matcher.embedder is None
    assert _fallback_count("runtime") == before + 1
    assert matcher.same("DOB", "date_of_birth")
    forget_matchers()


def test_rules_setting_never_loads_the_model() -> None:
    forget_matchers()
    before = sum(_fallback_count(r) for r in ("missing", "checksum", "runtime", "broken"))
    matcher = get_matcher(Settings(key_matching="rules"))
    assert matcher.embedder is None and matcher.model_id is None
    assert sum(_fallback_count(r) for r in ("missing", "checksum", "runtime", "broken")) == before
    forget_matchers()


def test_worker_main_process_preloads_the_matcher_and_forked_children_use_it(tmp_path: Path) -> None:
    # A fresh interpreter, as `celery worker` starts: the hook loads the model there, and
    # a forked child (a pool process) answers with it without loading anything again.
    script = (
        "import os, sys\n"
        "from worker import celery_hooks\n"
        "from worker.keymatch import get_matcher\n"
        "from worker.settings import get_settings\n"
        "celery_hooks._preload_key_matcher(get_settings())\n"
        "matcher = get_matcher(get_settings())\n"
        "assert matcher.embedder is not None\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    child = get_matcher(get_settings())\n"
        "    ok = child is matcher and child.same('birthday', 'date_of_birth')\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "REVERIE_LOG_FORMAT": "json"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "child 0"
    assert "key matcher preloaded" in done.stderr + done.stdout


def test_key_matching_benchmark_quick_mode_meets_its_goals() -> None:
    from bench.key_matching import measure

    rows = measure(quick=True)
    assert [r.what for r in rows if r.passed is False] == []
    assert sum(r.passed is True for r in rows) == 4


def test_stored_vectors_wait_for_the_callers_commit_and_for_no_one_elses(pg_settings: Settings) -> None:
    # Vectors are stored once the caller's work commits (a run that lost its user to an
    # erasure stores none of that user's keys after the erasure), in a transaction of
    # their own: two pool processes dreaming chunks that share keys never wait for each
    # other's whole chunk, and the first one stored is kept.
    vector = bytes(range(16))
    stored: list[int] = []
    lost: list[int] = []
    with session_scope(pg_settings) as long_running:
        key_vectors.save(
            long_running, "test-model", {"date_of_birth": vector}, then=lambda: stored.append(1), lost=lost.clear
        )
        with session_scope(pg_settings) as other:
            assert key_vectors.load(other, "test-model", ["date_of_birth"]) == {}
            # Storing it from elsewhere meanwhile neither waits nor fails.
            other.execute(text("SET LOCAL lock_timeout = '2s'"))
            key_vectors.save(other, "test-model", {"date_of_birth": bytes(16)})
        with session_scope(pg_settings) as after_other:
            assert key_vectors.load(after_other, "test-model", ["date_of_birth"]) == {"date_of_birth": bytes(16)}
    assert stored == [1]
    with session_scope(pg_settings) as after:
        assert key_vectors.load(after, "test-model", ["date_of_birth"]) == {"date_of_birth": bytes(16)}
    # A caller whose work rolls back stores nothing, and is told so.
    with session_scope(pg_settings) as rolled_back:
        key_vectors.save(rolled_back, "test-model", {"birthday": vector}, lost=lambda: lost.append(1))
        rolled_back.rollback()
    with session_scope(pg_settings) as after:
        assert key_vectors.load(after, "test-model", ["birthday"]) == {}
    assert lost == [1]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("город", "профессия"),  # city, profession: alike to a model that reads single letters
        ("名前", "住所"),  # name, address
        ("😀😀😀😀😀", "___"),
        ("🏠", "🎂"),
    ],
)
def test_keys_the_model_cannot_read_match_only_by_their_rules_form(model_matcher: KeyMatcher, a: str, b: str) -> None:
    assert model_matcher.similarity(a, b) is not None
    assert not model_matcher.same(a, b)
    assert model_matcher.find(a, [b]) is None
    assert model_matcher.same(a, a.upper()) and model_matcher.find(a.upper(), [b, a]) == a


def test_what_the_model_reads_is_a_key_of_latin_letters_or_digits() -> None:
    from worker.keymatch import readable

    assert readable("home_city") and readable("café_name") and readable("straße") and readable("pin_2")
    assert not readable("город") and not readable("東京_office") and not readable("___") and not readable("")


def test_thousands_of_look_alike_keys_are_matched_in_bounded_memory_and_time(tmp_path: Path) -> None:
    # A host that numbers its keys (note_1 ... note_3000): every pair of them scores over
    # the threshold. Each key is weighed against its closest few only, and the model runs
    # a batch at a time, so one user's many new keys cannot take the worker's memory
    # (before: 1.7 GB and 67 s for 4,000 such keys; the model alone grew with the batch).
    # The true synonyms among them are still found.
    script = tmp_path / "many.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, resource, sys, time
            from worker.keymatch import NEIGHBOURS, get_matcher
            from worker.settings import Settings
            matcher = get_matcher(Settings(_env_file=None, key_matching="embedding"))
            assert matcher.embedder is not None
            keys = [f"note_{i}" for i in range(3000)] + ["birthday", "date_of_birth", "home_city", "work_city"]
            began = time.process_time()
            groups = matcher.groups(keys)
            print(json.dumps({
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "most_matches": max(len(m) for m in matcher._matches.values()),
                "neighbours": NEIGHBOURS,
                "birthday": groups["birthday"] == groups["date_of_birth"],
                "cities": groups["home_city"] == groups["work_city"],
                "notes": len({groups[k] for k in keys[:3000]}),
            }))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["birthday"] and not got["cities"]
    assert got["notes"] == 3000  # numbered notes are different facts
    assert got["most_matches"] <= got["neighbours"]
    assert got["rss_mb"] < 700, got


def test_a_true_match_is_found_behind_look_alikes_the_rules_refuse_whatever_the_order_keys_came_in() -> None:
    # diet_1 ... diet_50 score closer to ``diet`` than ``dietary_preference`` does, and
    # are each refused (a number is another fact); the one true match is still found,
    # whether its key came before them, after them, or with them.
    look_alikes = [f"diet_{i}" for i in range(1, 51)]
    orders = {
        "pair first": [["diet", "dietary_preference"], look_alikes],
        "one batch": [["diet", "dietary_preference", *look_alikes]],
        "key last": [["dietary_preference", *look_alikes], ["diet"]],
    }
    for name, batches in orders.items():
        forget_matchers()
        matcher = get_matcher(Settings(key_matching="embedding"))
        assert matcher.embedder is not None
        for batch in batches:
            matcher.embed([matcher.normalise(k) for k in batch])
        assert matcher.same("diet", "dietary_preference"), name
        assert matcher.find("diet", ["dietary_preference", *look_alikes]) == "dietary_preference", name
        assert not matcher.same("diet", "diet_1"), name
    forget_matchers()


def test_a_proposed_key_written_as_a_new_entry_has_its_vector_stored_by_the_next_dream(make_settings: Any) -> None:
    # A session end proposes a key that matches none of ann's, so it is written as a new
    # entry: a key her rows now hold. Its vector, computed for the signal and held in
    # memory only, is stored by the next dream in the same process, so that a new
    # process's sweep runs no inference.
    from store.models import KeyVector
    from tasks.dream import dream_users
    from tests.dream_seed import entries_of, entry, seed
    from tests.test_canonical_writes import say
    from worker.keymatch import forget_matchers, get_matcher

    settings = make_settings(known_entries_token_budget=0, key_matching="embedding", summarize_interactions=False)
    forget_matchers()
    seed(settings, [entry("ann", "contact_jane_doe_phone", "555-0101")])
    say(settings, "ann", "My shoe size is 42.")
    keys = {row["key"] for row in entries_of(settings, "ann").values()}
    new_key = next(k for k in keys - {"contact_jane_doe_phone"})
    matcher = get_matcher(settings)

    def forms() -> set[str]:
        with session_scope(settings) as session:
            return set(session.scalars(select(KeyVector.norm_key)))

    assert matcher.normalise(new_key) not in forms()
    assert all(o.status == "succeeded" for o in dream_users(settings, ["ann"]))
    assert matcher.normalise(new_key) in forms()
    forget_matchers()
    second = get_matcher(settings)
    assert second.embedder is not None
    dream_users(settings, ["ann"])
    assert second.embedder.inferences == 0
    forget_matchers()


def test_a_held_back_vector_whose_write_rolls_back_is_stored_by_the_next_write(store_settings: Settings) -> None:
    # A proposed key's vector is held in memory; once a row holds the key, the next
    # prepare stores it when the caller's transaction commits. If that one rolls back,
    # the vector is still held back, and the next prepare stores it (else every new
    # process would run the model on that key again).
    from store.models import KeyVector

    settings = store_settings.model_copy(update={"key_matching": "embedding"})
    forget_matchers()
    matcher = get_matcher(settings)
    form = matcher.normalise("jane_doe_mobile_number")

    def forms() -> set[str]:
        with session_scope(settings) as session:
            return set(session.scalars(select(KeyVector.norm_key)))

    with session_scope(settings) as session:
        assert key_vectors.prepare(session, matcher, [], proposed=["jane_doe_mobile_number"]) == 1
    assert form not in forms()
    with pytest.raises(RuntimeError), session_scope(settings) as session:
        key_vectors.prepare(session, matcher, ["jane_doe_mobile_number"])
        raise RuntimeError("the caller's transaction fails after the write")
    assert form not in forms()
    with session_scope(settings) as session:
        assert key_vectors.prepare(session, matcher, ["jane_doe_mobile_number"]) == 0
    assert form in forms()
    # Stored and committed: no longer held back.
    assert matcher.held_back(["jane_doe_mobile_number"]) == {}
    forget_matchers()
