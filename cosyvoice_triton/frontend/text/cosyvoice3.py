"""CosyVoice3's text conventions: the system prompt before ``<|endofprompt|>``, and where the LM requires that token.

The official CosyVoice3 LM asserts that ``<|endofprompt|>`` occurs in its text input: in the prompt text or the text
to speak (one string given), in the prompt text alone (text arriving as a stream: the LM puts everything up to it
first, before the speech prompt). The official examples write it after a short system prompt:

- zero-shot: prompt text ``"You are a helpful assistant.<|endofprompt|>"`` + the transcript of the prompt audio;
- instruct2: the instruct text, in place of the prompt text:
  ``"You are a helpful assistant. <instruction><|endofprompt|>"``;
- cross-lingual (no prompt text): the text itself starts with ``"You are a helpful assistant.<|endofprompt|>"``.

A text holding ``<|`` and ``|>`` skips normalisation and splitting (the official ``text_normalize``), so a
zero-shot prompt text with the system prompt is tokenized as written, and a cross-lingual text is one segment.
:func:`require_endofprompt` refuses what the official LM would refuse, with a :class:`~...errors.TextError` that
says where the token belongs; the ``*_text`` helpers write the official forms.
"""

from __future__ import annotations

from ...errors import TextError
from .tokenizer import ENDOFPROMPT

SYSTEM_PROMPT = "You are a helpful assistant."
MODES = ("zero_shot", "cross_lingual", "instruct2")

_WHERE = {
    "zero_shot": f"the prompt text starts with '{SYSTEM_PROMPT}{ENDOFPROMPT}' and then the transcript of the "
                 "prompt audio",
    "cross_lingual": f"the text starts with '{SYSTEM_PROMPT}{ENDOFPROMPT}' (there is no prompt text)",
    "instruct2": f"the instruct text is '{SYSTEM_PROMPT} <instruction>{ENDOFPROMPT}'",
}


def zero_shot_prompt_text(transcript: str) -> str:
    """The zero-shot prompt text of the official examples: the system prompt, ``<|endofprompt|>``, the transcript."""
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}"


def instruct_text(instruction: str) -> str:
    """The instruct2 text of the official examples, e.g. ``instruct_text("请用广东话表达。")``."""
    return f"{SYSTEM_PROMPT} {instruction}{ENDOFPROMPT}"


def cross_lingual_text(text: str) -> str:
    """The text to speak in cross-lingual mode, as the official examples write it (system prompt first)."""
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{text}"


_MODE_ALIASES = {"instruct": "instruct2"}  # CosyVoice2's name of the mode


def resolve_mode(mode: str | None, prompt_text: str | None, instruct: str | None, *, speaker: bool = False) -> str:
    """The CosyVoice3 mode of a request: ``mode`` (``instruct`` reads as ``instruct2``), else from the inputs:
    instruct2 with an instruction, zero-shot with a prompt text (or a registered ``speaker``), else cross-lingual."""
    if mode is None:
        if instruct is not None:
            return "instruct2"
        return "zero_shot" if prompt_text is not None or speaker else "cross_lingual"
    mode = _MODE_ALIASES.get(mode.strip(), mode.strip())
    if mode not in MODES:
        raise TextError(f"mode must be one of {', '.join(MODES)} for CosyVoice3, got {mode!r}")
    return mode


def with_system_prompt(mode: str, text: str, prompt_text: str | None, instruct: str | None
                       ) -> tuple[str, str | None, str | None]:
    """(text, prompt text, instruct text) with the official examples' system prompt and ``<|endofprompt|>`` where
    the mode needs them and the caller left them out; what already holds ``<|endofprompt|>`` stays as given."""
    if mode == "zero_shot" and prompt_text is not None and ENDOFPROMPT not in prompt_text:
        prompt_text = zero_shot_prompt_text(prompt_text)
    elif mode == "instruct2" and instruct is not None and ENDOFPROMPT not in instruct:
        instruct = instruct_text(instruct)
    elif mode == "cross_lingual" and ENDOFPROMPT not in text:
        text = cross_lingual_text(text)
    return text, prompt_text, instruct


def require_endofprompt(prompt_text: str, text: str, *, mode: str, streamed: bool = False) -> None:
    """Raise :class:`TextError` when the CosyVoice3 LM would refuse this input for lack of ``<|endofprompt|>``.

    ``prompt_text``: the zero-shot prompt text or the instruct text (``""`` in cross-lingual mode); ``text``: the
    text to speak (ignored when ``streamed``: text arriving in pieces, where the official LM looks in the prompt
    text only). ``mode``: one of :data:`MODES`, named in the error with the official form."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if ENDOFPROMPT in prompt_text or (not streamed and ENDOFPROMPT in text):
        return
    if streamed and mode == "cross_lingual":
        raise TextError(f"CosyVoice3 needs {ENDOFPROMPT} in the prompt text when the text arrives in pieces, and "
                        "cross-lingual mode has no prompt text: use zero-shot or instruct2 for streamed text")
    looked = "the prompt text" if streamed else "the prompt text or the text"
    raise TextError(f"CosyVoice3 needs {ENDOFPROMPT} in {looked} ({mode}): {_WHERE[mode]}")
