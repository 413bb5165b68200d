"""DeepSeek-V4 tokenizer: a thin wrapper over a `tokenizers` tokenizer.json.

Works with the official tokenizer.json (byte-level BPE, 129280 embedding rows, special tokens at
128xxx) and with the small tokenizer we train for the tiny default model, which carries the same
special-token strings at small ids. Ids are always looked up in the file; the table of official ids
below is used only by `Tokenizer.is_official_vocab` (docs/model.md section 8).

Text that looks like a special token stays text: `Tokenizer.encode(text)` tokenizes every character of
``text`` as ordinary text, so a user typing ``<｜end▁of▁sentence｜>`` gets the ids of those characters, never
the EOS id. ``encode(text, allow_special=True)`` is the raw path for strings our own code built: there
special-token strings become their ids. Chat prompts get their control-token ids from
`dsv4_jax.chat.encode_message_ids`, which encodes message content as text.

No BOS is ever added implicitly: callers prepend `Tokenizer.bos_id` (or the chat encoder emits it).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from typing import Iterable, Sequence

import tokenizers

# ``｜`` is U+FF5C (fullwidth vertical line), ``▁`` is U+2581 (lower one eighth block).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
ACTION = "<｜action｜>"
QUERY = "<｜query｜>"
AUTHORITY = "<｜authority｜>"
DOMAIN = "<｜domain｜>"
TITLE = "<｜title｜>"
EXTRACTED_URL = "<｜extracted_url｜>"
READ_URL = "<｜read_url｜>"

# Short names accepted by `Tokenizer.special_token_id` (the token string itself is accepted too).
SPECIAL_TOKENS: dict[str, str] = {
    "bos": BOS,
    "eos": EOS,
    "user": USER,
    "assistant": ASSISTANT,
    "think_start": THINK_START,
    "think_end": THINK_END,
    "dsml": DSML,
    "latest_reminder": LATEST_REMINDER,
    "action": ACTION,
    "query": QUERY,
    "authority": AUTHORITY,
    "domain": DOMAIN,
    "title": TITLE,
    "extracted_url": EXTRACTED_URL,
    "read_url": READ_URL,
}

# Ids in the official DeepSeek-V4 tokenizer.json (docs/model.md section 8; differ from V3.x).
OFFICIAL_SPECIAL_IDS: dict[str, int] = {
    BOS: 0,
    EOS: 1,
    USER: 128803,
    ASSISTANT: 128804,
    THINK_START: 128821,
    THINK_END: 128822,
    DSML: 128825,
    LATEST_REMINDER: 128828,
    ACTION: 128829,
    QUERY: 128830,
    AUTHORITY: 128831,
    DOMAIN: 128832,
    TITLE: 128836,
    EXTRACTED_URL: 128844,
    READ_URL: 128845,
}

OFFICIAL_VOCAB_SIZE = 129280  # embedding rows of Flash / Pro


def _check_text(text, where: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where} expects a str, got {type(text).__name__}")


def _resolve_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path} (expected a tokenizer.json or a directory holding one)")
    return path


class Tokenizer:
    """DeepSeek-V4 tokenizer loaded from ``tokenizer.json`` (a file, or a directory holding one)."""

    def __init__(self, path: str | os.PathLike):
        self.path = _resolve_path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(self.path)
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"invalid tokenizer file {self.path}: {first_line}") from None
        self._attach(backend)

    @classmethod
    def from_tokenizers(cls, tok: tokenizers.Tokenizer) -> "Tokenizer":
        """Wrap an in-memory `tokenizers.Tokenizer` (e.g. one just trained)."""
        self = cls.__new__(cls)
        self.path = None
        self._attach(tok)
        return self

    def _attach(self, backend: tokenizers.Tokenizer) -> None:
        self._tok = backend
        self._bos_id = self._require(BOS)
        self._eos_id = self._require(EOS)
        vocab = backend.get_vocab(with_added_tokens=True)
        # Max id + 1, so gaps in the id space (possible with added tokens) still fit in an embedding.
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        added = sorted(backend.get_added_tokens_decoder().items())
        self._special_tokens = [t.content for _, t in added if t.special]
        self._special_ids = frozenset(i for i, t in added if t.special)
        self._flag_lock = threading.Lock()  # guards the backend's encode_special_tokens flag

    def _require(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            where = self.path or "in-memory tokenizer"
            raise ValueError(f"invalid tokenizer file {where}: it has no token {token!r}")
        return token_id

    # -- ids -------------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1 (added tokens included)."""
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def special_token_id(self, name: str) -> int:
        """Id of a special token, by short name (``"user"``, ``"think_end"``, …) or by its string."""
        token = SPECIAL_TOKENS.get(name, name)
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            known = ", ".join(SPECIAL_TOKENS)
            raise ValueError(f"special token {name!r} is not in this tokenizer (short names: {known})")
        return token_id

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def is_official_vocab(self) -> bool:
        """True when every special token sits at its official DeepSeek-V4 id."""
        return all(self._tok.token_to_id(tok) == tid for tok, tid in OFFICIAL_SPECIAL_IDS.items())

    # -- text <-> ids ----------------------------------------------------------------------------
    @property
    def special_tokens(self) -> list[str]:
        """The strings of the added tokens marked special (the whole vocabulary's, not only ours), by id."""
        return list(self._special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @contextlib.contextmanager
    def _backend_for(self, allow_special: bool):
        """The backend, set to treat special-token strings as text unless ``allow_special``.

        ``encode_special_tokens`` is a flag on the backend object (True: special-token strings are
        tokenized as plain text), not a per-call argument. We set it for one call, under a lock, and put
        the previous value back, so concurrent calls and direct users of `backend` never see our setting.
        """
        with self._flag_lock:
            saved = self._tok.encode_special_tokens
            self._tok.encode_special_tokens = not allow_special
            try:
                yield self._tok
            finally:
                self._tok.encode_special_tokens = saved

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added.

        Every character is ordinary text by default (special-token strings are tokenized like any other
        text); ``allow_special=True`` maps special-token strings to their ids (for strings our code built).
        """
        _check_text(text, "Tokenizer.encode")
        with self._backend_for(allow_special) as backend:
            return backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """`encode` of each text (same ``allow_special`` meaning)."""
        texts = list(texts)
        for text in texts:
            _check_text(text, "Tokenizer.encode_batch")
        with self._backend_for(allow_special) as backend:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    def split_special_tokens(self, text: str) -> list[str | int]:
        """``text`` cut where ``encode(text, allow_special=True)`` finds special tokens, in order: the text
        between them (str) and their ids (int).

        Added tokens split the text before normalization and BPE, so encoding each str piece as text and
        keeping the ids gives exactly ``encode(text, allow_special=True)``. The cut points come from the
        backend's own match (its offsets), so its matching rules hold here too.
        """
        _check_text(text, "Tokenizer.split_special_tokens")
        with self._backend_for(True) as backend:
            encoding = backend.encode(text, add_special_tokens=False)
        pieces: list[str | int] = []
        pos = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids:
                if start > pos:
                    pieces.append(text[pos:start])
                pieces.append(token_id)
                pos = end
        if pos < len(text):
            pieces.append(text[pos:])
        return pieces

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def widened(self, vocab_size: int) -> "Tokenizer":
        """This tokenizer with a placeholder token `<id>` for every id from its vocabulary up to `vocab_size`: text
        in and out for a model whose vocabulary is larger than the tokenizer's, as a preset's geometry with random
        weights served for benchmarks: an id the model emits past the tokenizer's decodes to `<id>`, and text
        encodes as before unless it spells such a placeholder (added tokens are matched in the text)."""
        if vocab_size <= self._vocab_size:
            return self
        backend = tokenizers.Tokenizer.from_str(self._tok.to_str())
        backend.add_tokens([tokenizers.AddedToken(f"<{i}>", special=False, normalized=False)
                            for i in range(self._vocab_size, vocab_size)])
        return Tokenizer.from_tokenizers(backend)

    def save(self, path: str | os.PathLike) -> str:
        """Write tokenizer.json to ``path`` (a file, or a directory that gets a tokenizer.json)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self._tok.save(path)
        return path

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self._vocab_size}, official={self.is_official_vocab})"


class StreamDecoder:
    """Turns ids arriving one or a few at a time into text increments.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix yields a
    trailing U+FFFD. We keep a small window of ids (``_prefix`` .. end), decode it, and emit only the
    part beyond what the window's already-emitted ids (``_prefix`` .. ``_read``) decoded to, and only
    once it no longer ends in U+FFFD. Each window starts at a character boundary, so the concatenated
    increments equal ``decode(all_ids)``. Cost per step is bounded by the window, not the whole text.
    ``flush()`` emits whatever is held back (a genuinely invalid byte sequence then shows as U+FFFD,
    exactly as a full decode would).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and never decoded again
        self._read = 0  # ids before it are emitted
        self._chunks: list[str] = []

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, ids: int | Iterable[int]) -> str:
        """Add newly generated id(s); return the text that is now complete (possibly "")."""
        try:
            self._ids.append(operator.index(ids))  # a single int (Python or NumPy scalar)
        except TypeError:
            self._ids.extend(operator.index(i) for i in ids)
        if len(self._ids) == self._read:
            return ""
        done = self._decode(self._ids[self._prefix:self._read])
        # Usually the whole window is complete; if it ends mid-character, back off id by id so the
        # complete part of a multi-id push is still emitted.
        for end in range(len(self._ids), self._read, -1):
            window = self._decode(self._ids[self._prefix:end])
            if len(window) > len(done) and not window.endswith("\ufffd"):
                delta = window[len(done):]
                self._prefix, self._read = self._read, end
                self._chunks.append(delta)
                return delta
        return ""

    def update(self, all_ids: Sequence[int]) -> str:
        """Like `push`, given the whole (growing) id list instead of just the new ids."""
        if len(all_ids) < len(self._ids) or list(all_ids[: len(self._ids)]) != self._ids:
            raise ValueError("StreamDecoder.update: the id list must extend the ids seen so far")
        return self.push(list(all_ids[len(self._ids):]))

    def flush(self) -> str:
        """Emit any held-back text (end of generation)."""
        if self._read == len(self._ids):
            return ""
        done = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        delta = window[len(done):]
        self._prefix = self._read = len(self._ids)
        self._chunks.append(delta)
        return delta


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, extra_special_tokens: Sequence[str] = ()) -> Tokenizer:
    """Train a small byte-level BPE tokenizer carrying every DeepSeek-V4 special token.

    BOS gets id 0 and EOS id 1 like the official vocab; the other special tokens follow. Used for the
    tiny default model and for tests; the official tokenizer is never retrained.
    """
    specials = list(OFFICIAL_SPECIAL_IDS) + [t for t in extra_special_tokens if t not in OFFICIAL_SPECIAL_IDS]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer.from_tokenizers(tok)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    return Tokenizer(path)


__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "train_byte_level_bpe",
    "load_tokenizer",
    "SPECIAL_TOKENS",
    "OFFICIAL_SPECIAL_IDS",
    "OFFICIAL_VOCAB_SIZE",
    "BOS",
    "EOS",
    "USER",
    "ASSISTANT",
    "THINK_START",
    "THINK_END",
    "DSML",
    "LATEST_REMINDER",
]
