"""Text normalisation rules of the CosyVoice2 front end (``CosyVoiceFrontEnd.text_normalize``).

The official front end uses ``ttsfrd`` where it is installed and otherwise the WeTextProcessing runtime
``wetext`` (pinned there at 0.0.4, which downloads its FSTs from a model hub on first use). This module reproduces
the ``wetext`` path offline: the FSTs come from the ``wetext`` wheel (0.0.7 to 0.1.0 ship the same files, the
hub snapshot), and :func:`wetext_tn` applies them with the 0.0.4 runtime's rules (only text with a digit is
normalised; the verbaliser's output is not stripped). The rest are CosyVoice's own rules.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Literal

import regex

_CHINESE = re.compile(r"[\u4e00-\u9fff]")
_ONLY_PUNCTUATION = regex.compile(r"[\p{P}\p{S}]*")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")

ZH_SENTENCE_END = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_SENTENCE_END = (".", "?", "!", ";", ":")
CLOSING_QUOTES = ('"', "”")

TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20


def contains_chinese(text: str) -> bool:
    """Whether ``text`` holds a CJK unified ideograph (U+4E00..U+9FFF), the official language switch."""
    return _CHINESE.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """Whether ``text`` is empty or made only of Unicode punctuation (P*) and symbols (S*)."""
    return _ONLY_PUNCTUATION.fullmatch(text) is not None


@functools.lru_cache(maxsize=1)
def _wetext_graphs():
    # wetext 0.1.0 reads its FSTs once, at import (about 0.5 s); TokenParser is the runtime's tag reordering.
    from wetext.constants import FSTS
    from wetext.token_parser import TokenParser

    return FSTS, TokenParser


def wetext_tn(text: str, lang: Literal["zh", "en"]) -> str:
    """WeTextProcessing text normalisation (tagger, reorder, verbaliser) as the ``wetext`` 0.0.4 runtime runs it.

    Text without a decimal digit comes back unchanged; the verbaliser's output keeps its spaces (English output
    often ends with one).
    """
    if re.search(r"\d", text) is None:
        return text
    fsts, token_parser = _wetext_graphs()
    tagged = fsts[lang]["tn"]["tagger"](text)
    return fsts[lang]["tn"]["verbalizer"](token_parser(lang, "tn").reorder(tagged))


def replace_blank(text: str) -> str:
    """Drop each space that does not stand between two non-space ASCII characters.

    As in the official rule the character before position 0 is the last one (Python's ``text[-1]``); a space at
    the very end is dropped (the official rule raises there).
    """
    n = len(text)

    def keep(i: int) -> bool:
        if i + 1 >= n:
            return False
        after, before = text[i + 1], text[i - 1]
        return after.isascii() and after != " " and before.isascii() and before != " "

    return "".join(c for i, c in enumerate(text) if c != " " or keep(i))


def replace_corner_mark(text: str) -> str:
    """Read superscript two and three as 平方 / 立方."""
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    """Remove full-width round and lenticular brackets and backticks; an em-dash pair becomes a space."""
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    return text.replace("——", " ")


def spell_out_number(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace each run of ``str.isdigit`` characters by ``number_to_words(run)`` (inflect's English words)."""
    parts = []
    for is_digit, run in itertools.groupby(text, key=str.isdigit):
        chunk = "".join(run)
        parts.append(number_to_words(chunk) if is_digit else chunk)
    return "".join(parts)


def _sentences(text: str, ends: Sequence[str]) -> list[str]:
    # Cut after each sentence end; a closing quote right after an end goes with the sentence before it (taken
    # from the last sentence cut so far, as officially, even when the end mark itself opened no new sentence).
    out: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in ends:
            continue
        if i > start:
            out.append(text[start:i] + c)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            out.append((out.pop() if out else "") + text[i + 1])
            start = i + 2
        else:
            start = i + 1
    return out


def split_paragraph(
    text: str,
    length: Callable[[str], int],
    *,
    lang: Literal["zh", "en"],
    token_max_n: int = TOKEN_MAX_N,
    token_min_n: int = TOKEN_MIN_N,
    merge_len: int = MERGE_LEN,
    comma_split: bool = False,
) -> list[str]:
    """Cut ``text`` at sentence ends and regroup the sentences into segments of bounded length.

    ``length`` measures a piece (characters for Chinese, text tokens for English, as officially). A segment is
    closed before the sentence that would take it over ``token_max_n`` once it is longer than ``token_min_n``;
    a last segment shorter than ``merge_len`` joins the one before. A missing final sentence end is added
    (``。`` or ``.``).
    """
    ends = list(ZH_SENTENCE_END if lang == "zh" else EN_SENTENCE_END)
    if comma_split:
        ends += ["，", ","]
    if text[-1] not in ends:
        text += "。" if lang == "zh" else "."
    segments: list[str] = []
    current = ""
    for sentence in _sentences(text, ends):
        if length(current + sentence) > token_max_n and length(current) > token_min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def normalize_zh(text: str) -> str:
    """The Chinese branch before splitting: WeTextProcessing, then CosyVoice's punctuation and spacing rules."""
    text = wetext_tn(text, "zh").replace("\n", "")
    text = replace_corner_mark(replace_blank(text))
    text = text.replace(".", "。").replace(" - ", "，")
    return _TRAILING_COMMAS.sub("。", remove_bracket(text))


def normalize_en(text: str, number_to_words: Callable[[str], str]) -> str:
    """The English branch before splitting: WeTextProcessing, then digits left over spelled out by inflect."""
    return spell_out_number(wetext_tn(text, "en"), number_to_words)
