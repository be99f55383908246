"""``TextFrontend``: CosyVoice2's and CosyVoice3's text side (normalise, split, tokenize) with input checks."""

from __future__ import annotations

import logging
import os
import re
from typing import Literal, overload

import numpy as np

from ...errors import TextError
from . import normalize as tn
from .tokenizer import CONTROL_TAGS, COSYVOICE2, COSYVOICE3, ENDOFPROMPT, QwenTextTokenizer

log = logging.getLogger(__name__)

# Longest accepted text, in characters (after UTF-8 decoding). The official code has no limit; this one bounds the
# work of one request: about 40 segments of 80-100 characters, i.e. several minutes of speech.
MAX_TEXT_CHARS = 4096
# WeTextProcessing's work grows with the digits it reads: about quadratically with one run's length (a run of 2,000
# digits takes most of a minute) and by milliseconds per character of number-dense text. These bound it before it
# runs. The official front end reads a run of more than a dozen digits digit by digit; 32 covers card, account and
# phone numbers; longer runs are refused (write them in groups or words).
MAX_DIGIT_RUN = 32
MAX_DIGITS = 256
# Normalisation spells numbers and symbols out; the text it makes is bounded too (4 characters per input one).
MAX_NORMALIZED_CHARS = 4 * MAX_TEXT_CHARS

# What looks like a control tag: <|name|>, <name>, </name>, [name] with a short ASCII name.
_TAG_LIKE = re.compile(r"<\|[^<>|\s]{1,40}\|>|</?[A-Za-z][\w-]{0,39}>|\[[A-Za-z][\w-]{0,39}\]", re.ASCII)
# The official front end leaves text with both of these alone (it calls it SSML).
_SSML_OPEN, _SSML_CLOSE = "<|", "|>"
_DIGIT_RUN = re.compile(r"\d+")


def _as_text(text: str | bytes, what: str) -> str:
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TextError(f"{what}: invalid UTF-8 at byte {exc.start}: {exc.reason}") from exc
    if not isinstance(text, str):
        raise TextError(f"{what}: expected str or UTF-8 bytes, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TextError(f"{what}: invalid UTF-8 (lone surrogate at character {exc.start})") from exc
    return text


class TextFrontend:
    """Normalise, split and tokenize text as ``CosyVoiceFrontEnd`` does with ``wetext`` (not ``ttsfrd``).

    Parameters
    ----------
    blank_en_dir : str or os.PathLike
        ``CosyVoice-BlankEN`` folder with the Qwen2 tokenizer files.
    family : str
        ``"cosyvoice2"`` (default) or ``"cosyvoice3"``: the special tokens of the tokenizer (and so the known
        control tags), and for CosyVoice3 its ``<|endofprompt|>`` rule (see :mod:`.cosyvoice3`).
    max_chars : int
        Longest accepted text in characters (default :data:`MAX_TEXT_CHARS`).
    max_digit_run, max_digits : int
        Longest run of digits and most digits in one text (default :data:`MAX_DIGIT_RUN`, :data:`MAX_DIGITS`):
        they bound the work of number normalisation before it runs.
    max_normalized_chars : int
        Longest normalised text (default :data:`MAX_NORMALIZED_CHARS`).
    strict_tags : bool
        Reject text with something that looks like a control tag (``[xxx]``, ``<xxx>``, ``</xxx>``, ``<|xxx|>``)
        but is none of the family's special tokens; with ``False`` it is read as plain text, as officially.

    Notes
    -----
    The WeTextProcessing FSTs load once per process, on first use (about 0.5 s); the tokenizer once per instance.
    Nothing here depends on global state that a call changes, so one instance serves concurrent callers.
    """

    def __init__(self, blank_en_dir: str | os.PathLike, *, max_chars: int = MAX_TEXT_CHARS, strict_tags: bool = True,
                 max_digit_run: int = MAX_DIGIT_RUN, max_digits: int = MAX_DIGITS,
                 max_normalized_chars: int = MAX_NORMALIZED_CHARS, family: str = COSYVOICE2):
        for name, v in (("max_chars", max_chars), ("max_digit_run", max_digit_run), ("max_digits", max_digits),
                        ("max_normalized_chars", max_normalized_chars)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.tokenizer = QwenTextTokenizer(blank_en_dir, family)
        self.family = family
        self.max_chars = int(max_chars)
        self.max_digit_run, self.max_digits = int(max_digit_run), int(max_digits)
        self.max_normalized_chars = int(max_normalized_chars)
        self.strict_tags = bool(strict_tags)
        import inflect

        self._number_to_words = inflect.engine().number_to_words

    def check(self, text: str | bytes, *, what: str = "text") -> str:
        """Return ``text`` as ``str`` if it can be synthesised, else raise :class:`TextError` naming the problem."""
        text = _as_text(text, what)
        if not text.strip():
            raise TextError(f"{what} is empty" if not text else f"{what} holds only whitespace")
        if len(text) > self.max_chars:
            raise TextError(f"{what} has {len(text)} characters, more than the maximum {self.max_chars}")
        self._check_digits(text, what)
        if self.strict_tags:
            unknown = sorted({m for m in _TAG_LIKE.findall(text) if m not in self.tokenizer.known_tags})
            if unknown:
                phones = "; and ARPAbet / pinyin tags such as [HH] [AH0] [j] [ǐ]" if self.family == COSYVOICE3 else ""
                raise TextError(
                    f"{what} has unknown control tag(s) {', '.join(unknown)}; known: {', '.join(CONTROL_TAGS)}{phones}"
                )
        if tn.is_only_punctuation(re.sub(r"\s+", "", text)):
            raise TextError(f"{what} holds only punctuation and symbols: {text[:40]!r}")
        return text

    def _check_digits(self, text: str, what: str) -> None:
        digits = 0
        for m in _DIGIT_RUN.finditer(text):  # decimal digits of any script (what WeTextProcessing is run for)
            n = m.end() - m.start()
            if n > self.max_digit_run:
                raise TextError(f"{what} has a run of {n} digits at character {m.start()} ({m.group()[:12]}...), "
                                f"more than the maximum {self.max_digit_run}; write it in groups or in words")
            digits += n
        if digits > self.max_digits:
            raise TextError(f"{what} has {digits} digits, more than the maximum {self.max_digits} that one request "
                            f"may hold; split the text")

    @overload
    def normalize(self, text: str | bytes, *, split: Literal[True] = ..., text_frontend: bool = ...) -> list[str]: ...
    @overload
    def normalize(self, text: str | bytes, *, split: Literal[False], text_frontend: bool = ...) -> str: ...

    def normalize(self, text, *, split=True, text_frontend=True):
        """Normalise ``text`` and, with ``split=True``, cut it into the segments that are synthesised one by one.

        Official semantics: text holding both ``<|`` and ``|>`` and ``text_frontend=False`` skip normalisation
        (``[text]`` / ``text``); Chinese text (any CJK ideograph) goes through WeTextProcessing zh and the
        punctuation rules and is split by characters, other text through WeTextProcessing en and inflect and is
        split by tokens (80 max, 60 min, last segment under 20 merged); segments of only punctuation are dropped.
        ``split=False`` returns the whole normalised string.

        Raises
        ------
        TextError
            Empty, whitespace or punctuation only, too long, invalid UTF-8, an unknown control tag, or nothing
            left to say after normalisation.
        """
        text = self.check(text)
        if (_SSML_OPEN in text and _SSML_CLOSE in text) or not text_frontend:
            return [text] if split else text
        text = text.strip()
        if tn.contains_chinese(text):
            text, lang = tn.normalize_zh(text), "zh"
            length = len
        else:
            text, lang = tn.normalize_en(text, self._number_to_words), "en"

            def length(piece: str) -> int:
                return int(self.tokenizer.encode(piece).shape[0])

        if len(text) > self.max_normalized_chars:
            raise TextError(f"text has {len(text)} characters once numbers and symbols are spelled out, more than "
                            f"the maximum {self.max_normalized_chars}")
        if not split:
            return text
        segments = [s for s in tn.split_paragraph(text, length, lang=lang) if not tn.is_only_punctuation(s)]
        if not segments:
            raise TextError(f"text has nothing to say after normalisation: {text[:40]!r}")
        return segments

    def tokenize(self, text: str | bytes) -> np.ndarray:
        """Token ids of ``text`` as it stands (no normalisation), shape ``(n,)``, int64."""
        return self.tokenizer.encode(self.check(text))

    def tts_segments(self, text: str | bytes, *, text_frontend: bool = True) -> list[tuple[str, np.ndarray]]:
        """The text to synthesise: each normalised segment with its token ids (one LM call each)."""
        return [(s, self.tokenizer.encode(s)) for s in self.normalize(text, split=True, text_frontend=text_frontend)]

    def prompt_tokens(self, prompt_text: str | bytes, *, text_frontend: bool = True) -> np.ndarray:
        """Zero-shot prompt text (the transcript of the prompt audio): normalised unsplit, then tokenized."""
        return self.tokenizer.encode(self.normalize(prompt_text, split=False, text_frontend=text_frontend))

    def instruct_tokens(self, instruct_text: str | bytes, *, append_endofprompt: bool = False) -> np.ndarray:
        """Instruct text (``inference_instruct2``), tokenized as given (not normalised), as officially.

        The official examples end the instruction with ``<|endofprompt|>``; without it a warning is logged, and
        with ``append_endofprompt=True`` it is appended (then the ids are those of the text that has it). CosyVoice3
        requires it in the instruction or the text: see :func:`.cosyvoice3.require_endofprompt`."""
        text = self.check(instruct_text, what="instruct text")
        if not text.rstrip().endswith(ENDOFPROMPT):
            if append_endofprompt:
                text += ENDOFPROMPT
            else:
                log.warning("instruct text does not end with %s (the official examples end it so); tokenized as "
                            "given: %r", ENDOFPROMPT, text[:60])
        return self.tokenizer.encode(text)
