"""CosyVoice3 text front end: parity with the official CosyVoice3Tokenizer + text_normalize
(tests/fixtures/text_oracle/cosyvoice3.json), the official-id stand-in, and the <|endofprompt|> conventions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cosyvoice_triton.errors import TextError
from cosyvoice_triton.family import FAMILY_YAML
from cosyvoice_triton.frontend.text import TextFrontend, write_tokenizer_standin
from cosyvoice_triton.frontend.text.cosyvoice3 import (
    SYSTEM_PROMPT,
    cross_lingual_text,
    instruct_text,
    require_endofprompt,
    zero_shot_prompt_text,
)
from cosyvoice_triton.frontend.text.live import piece_tokens
from cosyvoice_triton.frontend.text.tokenizer import (
    ADDED_SPECIAL_TOKENS,
    ARPABET_TAGS,
    COSYVOICE3_ADDED_SPECIAL_TOKENS,
    ENDOFPROMPT,
    ENDOFSYSTEM,
    FAMILY_SPECIAL_TOKENS,
    PINYIN_TAGS,
    QwenTextTokenizer,
)
from cosyvoice_triton.models.cosyvoice3.llm import ENDOFPROMPT as LM_ENDOFPROMPT

ORACLE = Path(__file__).resolve().parents[1] / "fixtures" / "text_oracle"
REF = json.loads((ORACLE / "cosyvoice3.json").read_text())
STANDIN = ORACLE / REF["standin"]


@pytest.fixture(scope="module")
def frontend() -> TextFrontend:
    # strict_tags=False: the oracle has an unknown tag, which the official front end reads as text
    return TextFrontend(STANDIN, family="cosyvoice3", strict_tags=False)


def test_oracle_ran_on_the_committed_standin():
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(STANDIN.iterdir())} == \
        REF["standin_sha256"]


def test_special_tokens_are_the_official_ones_in_order(frontend):
    assert tuple(REF["special_ids"]) == COSYVOICE3_ADDED_SPECIAL_TOKENS
    assert COSYVOICE3_ADDED_SPECIAL_TOKENS[: len(ADDED_SPECIAL_TOKENS)] == ADDED_SPECIAL_TOKENS
    assert len(ARPABET_TAGS) == 84 and len(PINYIN_TAGS) == 176
    tok = frontend.tokenizer
    assert len(tok) == REF["tokenizer_len"]
    assert {t: tok.token_id(t) for t in COSYVOICE3_ADDED_SPECIAL_TOKENS} == REF["special_ids"]


@pytest.mark.parametrize("tag", [ENDOFSYSTEM, *ARPABET_TAGS[:6], ARPABET_TAGS[-1], *PINYIN_TAGS[::25], "[ǜ]"])
def test_cosyvoice3_tags_encode_to_one_id(frontend, tag):
    ids = frontend.tokenizer.encode(f"a{tag}b").tolist()
    assert len(ids) == 3 and ids[1] == frontend.tokenizer.token_id(tag)
    assert frontend.tokenizer.decode(ids) == "ab"


@pytest.mark.parametrize("case", REF["cases"], ids=[f"case{i}" for i in range(len(REF["cases"]))])
def test_normalize_and_tokens_match_official(frontend, case):
    segments = frontend.normalize(case["text"])
    assert segments == case["segments"]
    assert [frontend.tokenizer.encode(s).tolist() for s in segments] == case["tokens"]
    assert frontend.normalize(case["text"], split=False) == case["unsplit"]
    assert frontend.tokenizer.encode(case["text"]).tolist() == case["raw_tokens"]


def test_oracle_covers_the_cosyvoice3_conventions():
    texts = [c["text"] for c in REF["cases"]]
    # texts with the system prompt are left whole and unnormalised; tag texts are normalised
    skipped = [c for c in REF["cases"] if ENDOFPROMPT in c["text"]]
    assert len(skipped) >= 4 and all(c["segments"] == [c["text"]] for c in skipped)
    assert any("[j][ǐ]" in t for t in texts) and any("[HH]" in t for t in texts)
    assert any(ENDOFSYSTEM in t for t in texts)
    assert all(ENDOFPROMPT in i["text"] for i in REF["instructs"])


def test_prompt_and_instruct_tokens_match_official(frontend):
    for prompt in REF["prompts"]:
        assert frontend.prompt_tokens(prompt["text"]).tolist() == prompt["tokens"]
    for instruct in REF["instructs"]:
        assert frontend.instruct_tokens(instruct["text"]).tolist() == instruct["tokens"]


def test_official_forms_of_the_examples():
    assert zero_shot_prompt_text("希望你以后能够做的比我还好呦。") == REF["prompts"][0]["text"]
    assert instruct_text("请用广东话表达。") == REF["instructs"][0]["text"]
    cross = next(c["text"] for c in REF["cases"] if c["text"].startswith(SYSTEM_PROMPT + ENDOFPROMPT + "[breath]"))
    assert cross_lingual_text(cross.removeprefix(SYSTEM_PROMPT + ENDOFPROMPT)) == cross


def test_official_ids_standin_gives_the_official_special_ids(tmp_path):
    ref = REF["official_ids_standin"]
    folder = write_tokenizer_standin(tmp_path / "blank", ref["vocab_size"], official_ids=True)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())} == ref["sha256"]
    tok = QwenTextTokenizer(folder, family="cosyvoice3")
    assert len(tok) == ref["tokenizer_len"] < ref["vocab_size"]
    assert {t: tok.token_id(t) for t in COSYVOICE3_ADDED_SPECIAL_TOKENS} == ref["special_ids"]
    assert tok.token_id(ENDOFPROMPT) == LM_ENDOFPROMPT == 151646
    assert tok.encode(ref["example"]["text"]).tolist() == ref["example"]["tokens"]
    # the placeholders pad the vocabulary but no text reaches them
    vocab = json.loads((folder / "vocab.json").read_text())
    placeholder = next(t for t, i in vocab.items() if i == 151642)
    assert max(tok.encode(placeholder).tolist()) < 1000
    with pytest.raises(ValueError, match="at least 151924"):
        write_tokenizer_standin(tmp_path / "small", 151923, official_ids=True)


def test_the_same_files_under_cosyvoice2_lack_the_cosyvoice3_tags():
    cv2 = TextFrontend(STANDIN)
    with pytest.raises(TextError, match=r"unknown control tag\(s\) \[AH0\], \[HH\]"):
        cv2.check("say [HH][AH0] now")
    with pytest.raises(KeyError, match="not a cosyvoice2 special token"):
        cv2.tokenizer.token_id(ENDOFSYSTEM)
    extra = len(COSYVOICE3_ADDED_SPECIAL_TOKENS) - len(ADDED_SPECIAL_TOKENS)
    assert len(cv2.tokenizer) == REF["tokenizer_len"] - extra
    assert set(FAMILY_SPECIAL_TOKENS) == set(FAMILY_YAML) - {"cosyvoice"}  # the families' own names
    with pytest.raises(ValueError, match="no text tokenizer for model family 'cosyvoice1'"):
        QwenTextTokenizer(STANDIN, family="cosyvoice1")


def test_strict_tags_know_the_cosyvoice3_tags():
    strict = TextFrontend(STANDIN, family="cosyvoice3")
    assert strict.check("读[zh][òng]要 [HH][AH0][L][OW1] <|endofsystem|>")
    with pytest.raises(TextError, match=r"unknown control tag\(s\) \[NOPE\].*ARPAbet / pinyin"):
        strict.check("a [NOPE] b")
    ids = list(piece_tokens(strict.tokenizer, ["he said [HH]", "[AH0] fine"]))
    assert strict.tokenizer.token_id("[HH]") in ids and strict.tokenizer.token_id("[AH0]") in ids
    with pytest.raises(TextError, match=r"unknown control tag\(s\) \[NOPE\]"):
        list(piece_tokens(strict.tokenizer, ["a [NOPE] b"]))


@pytest.mark.parametrize(("prompt", "text", "mode", "streamed"), [
    (zero_shot_prompt_text("hello"), "text", "zero_shot", False),
    (zero_shot_prompt_text("hello"), "text", "zero_shot", True),
    ("hello", cross_lingual_text("text"), "zero_shot", False),  # the official LM looks in both
    ("", cross_lingual_text("text"), "cross_lingual", False),
    (instruct_text("speak softly"), "text", "instruct2", True),
])
def test_require_endofprompt_accepts_what_the_official_lm_accepts(prompt, text, mode, streamed):
    require_endofprompt(prompt, text, mode=mode, streamed=streamed)


@pytest.mark.parametrize(("prompt", "text", "mode", "streamed", "match"), [
    ("hello", "text", "zero_shot", False, r"in the prompt text or the text \(zero_shot\): the prompt text starts with "
                                          r"'You are a helpful assistant.<\|endofprompt\|>'"),
    ("hello", cross_lingual_text("text"), "zero_shot", True, r"in the prompt text \(zero_shot\)"),
    ("", "text", "cross_lingual", False, r"\(cross_lingual\): the text starts with"),
    ("", cross_lingual_text("text"), "cross_lingual", True, "cross-lingual mode has no prompt text"),
    ("speak softly", "text", "instruct2", False, r"the instruct text is 'You are a helpful assistant. <instruction>"),
])
def test_require_endofprompt_names_what_is_missing(prompt, text, mode, streamed, match):
    with pytest.raises(TextError, match=match):
        require_endofprompt(prompt, text, mode=mode, streamed=streamed)


def test_require_endofprompt_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of zero_shot, cross_lingual, instruct2"):
        require_endofprompt("", "", mode="vc")
