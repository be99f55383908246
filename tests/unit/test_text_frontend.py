"""Text front end: parity with the official CosyVoice2 front end (tests/fixtures/text_oracle), stand-in, errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_triton.errors import CheckpointError, TextError
from cosyvoice_triton.frontend.text import (
    ADDED_SPECIAL_TOKENS,
    CONTROL_TAGS,
    ENDOFPROMPT,
    MAX_TEXT_CHARS,
    TextFrontend,
    write_tokenizer_standin,
)
from cosyvoice_triton.frontend.text import normalize as tn

ORACLE = Path(__file__).resolve().parents[1] / "fixtures" / "text_oracle"
REF = json.loads((ORACLE / "official.json").read_text())
STANDIN = ORACLE / f"standin_{REF['standin_vocab_size']}"


@pytest.fixture(scope="module")
def frontend() -> TextFrontend:
    return TextFrontend(STANDIN)


@pytest.mark.parametrize("case", REF["cases"], ids=[f"case{i}" for i in range(len(REF["cases"]))])
def test_normalize_and_tokens_match_official(frontend, case):
    segments = frontend.normalize(case["text"])
    assert segments == case["segments"]
    assert [frontend.tokenizer.encode(s).tolist() for s in segments] == case["tokens"]
    assert frontend.normalize(case["text"], split=False) == case["unsplit"]
    assert frontend.tokenize(case["text"]).tolist() == case["raw_tokens"]


def test_oracle_covers_splitting_and_both_languages():
    assert len(REF["cases"]) >= 30
    assert sum(len(c["segments"]) > 1 for c in REF["cases"]) >= 3
    assert any(tn.contains_chinese(c["text"]) for c in REF["cases"])
    assert any(not tn.contains_chinese(c["text"]) for c in REF["cases"])


def test_tts_segments_pairs_text_and_ids(frontend):
    case = next(c for c in REF["cases"] if len(c["segments"]) > 2)
    pairs = frontend.tts_segments(case["text"])
    assert [s for s, _ in pairs] == case["segments"]
    for (_, ids), ref_ids in zip(pairs, case["tokens"], strict=True):
        assert ids.dtype == np.int64 and ids.ndim == 1
        np.testing.assert_array_equal(ids, ref_ids)


def test_prompt_and_instruct_tokens_match_official(frontend):
    for prompt in REF["prompts"]:
        assert frontend.prompt_tokens(prompt["text"]).tolist() == prompt["tokens"]
    for instruct in REF["instructs"]:
        assert frontend.instruct_tokens(instruct["text"]).tolist() == instruct["tokens"]



def test_instruct_tokens_as_given_by_default(frontend, caplog):
    # Official frontend_instruct2 tokenizes the instruction as given: without the marker, nothing is appended
    # (a warning says so); append_endofprompt=True gives the ids of the text that has it.
    first = REF["instructs"][0]
    bare = first["text"].removesuffix(ENDOFPROMPT)
    assert bare != first["text"]
    with caplog.at_level("WARNING", logger="cosyvoice_triton.frontend.text.frontend"):
        ids = frontend.instruct_tokens(bare).tolist()
    assert ids == frontend.tokenizer.encode(bare).tolist() != first["tokens"]
    assert any(ENDOFPROMPT in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="cosyvoice_triton.frontend.text.frontend"):
        assert frontend.instruct_tokens(first["text"]).tolist() == first["tokens"]
    assert not caplog.records
    assert frontend.instruct_tokens(bare, append_endofprompt=True).tolist() == first["tokens"]


def test_special_tokens_have_official_ids_and_stay_single(frontend):
    tok = frontend.tokenizer
    assert len(tok) == REF["tokenizer_len"]
    assert {t: tok.token_id(t) for t in ADDED_SPECIAL_TOKENS} == REF["special_ids"]
    for tag in CONTROL_TAGS:
        ids = tok.encode(f"a{tag}b")
        assert tok.token_id(tag) in ids.tolist() and len(ids) == 3, tag
    assert len(tok) < REF["standin_vocab_size"]
    assert tok.decode(tok.encode("你好[breath]world")) == "你好world"
    assert tok.decode(tok.encode("你好[breath]world"), skip_special_tokens=False) == "你好[breath]world"


def test_standin_is_deterministic_and_loads_as_qwen2(tmp_path):
    out = write_tokenizer_standin(tmp_path / "blank", REF["standin_vocab_size"])
    written = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
    assert written == REF["standin_sha256"]
    assert not (out / "config.json").exists()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert type(hf).__name__ in ("Qwen2TokenizerFast", "Qwen2Tokenizer")
    n_bpe = len(json.loads((out / "vocab.json").read_text()))
    assert hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [n_bpe, n_bpe + 1, n_bpe + 2]
    assert "stand-in" in (out / "README.md").read_text().lower()


def test_standin_at_full_size_and_too_small(tmp_path):
    full = TextFrontend(write_tokenizer_standin(tmp_path / "full", 151936))
    assert len(full.tokenizer) < 151936
    assert full.tokenizer.token_id(ENDOFPROMPT) == len(full.tokenizer) - len(CONTROL_TAGS) - 1
    with pytest.raises(ValueError, match="vocab_size 300"):
        write_tokenizer_standin(tmp_path / "small", 300)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "text is empty"),
        (" \n\t ", "only whitespace"),
        ("。，！？...", "only punctuation"),
        ("  ¥%、—  ", "only punctuation"),
        (b"\xff\xfehello", "invalid UTF-8 at byte 0"),
        ("abc\udcff", "lone surrogate"),
        ("我们[foo]开始吧", r"unknown control tag\(s\) \[foo\]"),
        ("say <em>this</em> now", "</em>, <em>"),
        ("<|en|>Hello there", r"<\|en\|>"),
        ("x" * (MAX_TEXT_CHARS + 1), f"{MAX_TEXT_CHARS + 1} characters, more than the maximum {MAX_TEXT_CHARS}"),
        (12345, "expected str or UTF-8 bytes"),
    ],
)
def test_bad_text_raises_text_error(frontend, text, match):
    with pytest.raises(TextError, match=match):
        frontend.normalize(text)
    with pytest.raises(TextError):
        frontend.tokenize(text)


def test_bytes_input_and_non_strict_tags(frontend):
    text = "今天是2024年3月5日。"
    assert frontend.normalize(text.encode("utf-8")) == frontend.normalize(text)
    lenient = TextFrontend(STANDIN, strict_tags=False)
    assert lenient.normalize("Say [foo] twice") == ["Say [foo] twice."]
    with pytest.raises(TextError, match="empty"):
        frontend.instruct_tokens("")


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(CheckpointError, match="vocab.json"):
        TextFrontend(tmp_path)


def test_rules():
    assert tn.replace_blank("你 好 a b 世界 ") == "你好a b世界"
    assert tn.remove_bracket("（一）【二】`三`——四") == "一二三 四"
    assert tn.spell_out_number("a12b3", lambda s: f"<{int(s)}>") == "a<12>b<3>"
    assert tn.is_only_punctuation("") and tn.is_only_punctuation("…$") and not tn.is_only_punctuation("a.")
    # A quote after a sentence end stays with that sentence; a short tail merges into the previous segment.
    text = "一二三。“四五！”六七八九十。十一"
    segments = tn.split_paragraph(text, len, lang="zh", token_max_n=6, token_min_n=2, merge_len=4)
    assert segments == ["一二三。", "“四五！”", "六七八九十。十一。"]
    assert tn.split_paragraph("Hi", len, lang="en") == ["Hi."]
