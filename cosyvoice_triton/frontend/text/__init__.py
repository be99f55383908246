"""CosyVoice2 text front end: normalisation (WeTextProcessing + CosyVoice rules), splitting, Qwen2 tokens."""

from .frontend import MAX_TEXT_CHARS, TextFrontend
from .standin import write_tokenizer_standin
from .tokenizer import ADDED_SPECIAL_TOKENS, CONTROL_TAGS, ENDOFPROMPT, QwenTextTokenizer

__all__ = [
    "ADDED_SPECIAL_TOKENS",
    "CONTROL_TAGS",
    "ENDOFPROMPT",
    "MAX_TEXT_CHARS",
    "QwenTextTokenizer",
    "TextFrontend",
    "write_tokenizer_standin",
]
