"""Text that arrives in pieces (live text to speech): pieces to text tokens as the official front end does with a
text generator, and a blocking feed of pieces.

The official ``CosyVoiceFrontEnd`` skips normalisation for a generator (``text_normalize`` returns it as is) and
tokenizes each piece on its own (``_extract_text_token_generator``), handing the LM one token at a time. So
:func:`piece_tokens` does not normalise either, and a word cut between two pieces is tokenized as two texts
("hel" + "lo" gives the ids of "hel" then those of "lo", not those of "hello"), as officially.

Pieces are ``str`` or UTF-8 ``bytes``. Bytes go through one incremental decoder, so a character split between
pieces is whole in the text (the piece boundary moves to after it); invalid or unfinished UTF-8 raises
:class:`~...errors.TextError` naming the byte offset in the stream.
"""

from __future__ import annotations

import codecs
import queue
import threading
from collections.abc import Iterable, Iterator

from ...errors import TextError
from .frontend import _TAG_LIKE
from .tokenizer import KNOWN_TAGS


def piece_texts(pieces: Iterable[str | bytes], *, max_chars: int | None = None, strict_tags: bool = True,
                known_tags: frozenset[str] = KNOWN_TAGS) -> Iterator[str]:
    """The pieces as ``str`` (bytes decoded incrementally; an empty result is skipped), checked: valid UTF-8, no
    lone surrogate, at most ``max_chars`` characters in all, no control tag outside ``known_tags`` (default
    CosyVoice2's) within a piece (``strict_tags``), and some non-whitespace text by the end."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = chars = 0
    seen_text = False
    for piece in pieces:
        if isinstance(piece, bytes | bytearray | memoryview):
            data = bytes(piece)
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(data)
            except UnicodeDecodeError as exc:
                raise TextError(f"text piece: invalid UTF-8 at byte {consumed - pending + exc.start} of the "
                                f"stream: {exc.reason}") from None
            consumed += len(data)
        elif isinstance(piece, str):
            if decoder.getstate()[0]:
                raise TextError(f"text piece: a str piece after bytes that end inside a UTF-8 character (byte "
                                f"{consumed} of the stream)")
            text = piece
        else:
            raise TextError(f"text piece: expected str or UTF-8 bytes, got {type(piece).__name__}")
        if not text:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TextError(f"text piece: invalid text (lone surrogate at character {chars + exc.start})") from None
        chars += len(text)
        if max_chars is not None and chars > max_chars:
            raise TextError(f"text has more than the maximum {max_chars} characters")
        if strict_tags:
            unknown = sorted({m for m in _TAG_LIKE.findall(text) if m not in known_tags})
            if unknown:
                raise TextError(f"text piece has unknown control tag(s) {', '.join(unknown)}")
        seen_text = seen_text or bool(text.strip())
        yield text
    if decoder.getstate()[0]:
        raise TextError(f"text ends inside a UTF-8 character (byte {consumed} of the stream)")
    if not seen_text:
        raise TextError("text is empty" if not chars else "text holds only whitespace")


def piece_tokens(tokenizer, pieces: Iterable[str | bytes], **checks) -> Iterator[int]:
    """Text token ids of the pieces, one by one as the official front end hands them to the LM: each piece
    tokenized on its own, not normalised. ``tokenizer``: a :class:`.QwenTextTokenizer` (its family's tags are
    the known ones); ``checks``: see :func:`piece_texts`."""
    checks.setdefault("known_tags", tokenizer.known_tags)
    for text in piece_texts(pieces, **checks):
        for token in tokenizer.encode(text).tolist():
            yield int(token)


class LiveText(Iterator[str | bytes]):
    """A blocking iterator of text pieces fed from another thread: :meth:`put` a piece, :meth:`end` the text.

    Iterating waits for the next piece; :meth:`end` (or ``wait_s`` seconds without a piece, when set) ends it
    with what it has: the pieces already put are still read, then the iteration stops. :attr:`timed_out` tells
    whether the wait ran out."""

    _END = object()

    def __init__(self, pieces: Iterable[str | bytes] = (), *, wait_s: float | None = None):
        if wait_s is not None and not wait_s > 0:
            raise ValueError(f"wait_s must be > 0 or None, got {wait_s}")
        self.wait_s = wait_s
        self.timed_out = False
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ended = self._done = False
        for piece in pieces:
            self.put(piece)

    def put(self, piece: str | bytes) -> None:
        with self._lock:
            if self._ended:
                raise TextError("text piece after the end of the text")
            self._queue.put(piece)

    def end(self) -> None:
        """No more pieces: the iteration stops after those already put (calling it again does nothing)."""
        with self._lock:
            if not self._ended:
                self._ended = True
                self._queue.put(self._END)

    @property
    def ended(self) -> bool:
        return self._ended

    def __next__(self) -> str | bytes:
        if self._done:
            raise StopIteration
        try:
            piece = self._queue.get(timeout=self.wait_s)
        except queue.Empty:  # end with what it has: a piece put just now still comes, then the end marker
            self.timed_out = True
            self.end()
            piece = self._queue.get()
        if piece is self._END:
            self._done = True
            raise StopIteration
        return piece
