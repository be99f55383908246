"""Reading cosyvoice2.yaml inertly: tags are data, references and arithmetic are resolved."""

from __future__ import annotations

import json

import pytest
from conftest import FLOW_ORACLE

from cosyvoice_triton.config import ModelConfig, load_hyperpyyaml, write_yaml
from cosyvoice_triton.errors import ConfigError


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_yaml_round_trip(tmp_path, size):
    config = getattr(ModelConfig, size)()
    write_yaml(config, tmp_path / "cosyvoice2.yaml")
    text = (tmp_path / "cosyvoice2.yaml").read_text()
    assert "!new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec" in text
    assert "static_chunk_size: !ref <chunk_size> * <token_mel_ratio>" in text
    assert ModelConfig.from_yaml(tmp_path / "cosyvoice2.yaml") == config


def test_refs_and_arithmetic():
    doc = load_hyperpyyaml(
        "a: 25\nb: 2\nc: !ref <a> * <b>\nd: !ref <c>\ne: !ref <a> - <b> * 2\n"
        "m: !new:x.Y\n  k: !ref <a>\n  nested: {q: !ref <m.k>}\n"
    )
    assert (doc["c"], doc["d"], doc["e"]) == (50, 50, 21)
    assert doc["m"]["__class__"] == "x.Y" and doc["m"]["k"] == 25 and doc["m"]["nested"]["q"] == 25


def test_tags_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    doc = load_hyperpyyaml(f"x: !apply:os.system ['touch {marker}']\ny: !name:builtins.print\n")
    assert doc["x"] == {"__class__": "os.system", "__args__": [f"touch {marker}"]}
    assert not marker.exists()
    with pytest.raises(ConfigError):  # plain PyYAML python tags are refused by the safe loader
        ModelConfig.from_yaml(_write(tmp_path, "flow: !!python/object/apply:os.system ['true']\n"))


def _write(tmp_path, text):
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a: !ref <missing>\n", "names no key"),
        ("a: !ref <b>\nb: !ref <a>\n", "circular"),
        ("a: 1\nb: !ref <a> ** __import__('os')\n", "unsupported expression in !ref"),
        ("- 1\n- 2\n", "top level is not a mapping"),
        ("sample_rate: 24000\n", "unexpected structure"),
        ("flow: [unclosed\n", "cannot parse"),
    ],
)
def test_bad_yaml_is_reported(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_yaml(_write(tmp_path, text))


def test_missing_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_yaml(tmp_path / "cosyvoice2.yaml")


def _check_tiny_dims(dims: dict) -> None:
    tiny = ModelConfig.tiny()
    enc, est, hift = dims["flow"]["encoder"], dims["flow"]["decoder"]["estimator"], dims["hift"]
    assert (tiny.flow.encoder.attention_heads, tiny.flow.encoder.linear_units, tiny.flow.encoder.num_blocks) == (
        enc["attention_heads"], enc["linear_units"], enc["num_blocks"])
    assert tiny.flow.encoder.static_chunk_size == enc["static_chunk_size"]
    assert list(tiny.flow.estimator.channels) == est["channels"]
    assert (tiny.flow.estimator.n_blocks, tiny.flow.estimator.num_mid_blocks, tiny.flow.estimator.num_heads,
            tiny.flow.estimator.attention_head_dim, tiny.flow.estimator.static_chunk_size) == (
        est["n_blocks"], est["num_mid_blocks"], est["num_heads"], est["attention_head_dim"], est["static_chunk_size"])
    assert tiny.hift.base_channels == hift["base_channels"]
    assert tiny.hift.f0_predictor.cond_channels == hift["f0_predictor"]["cond_channels"]
    assert list(tiny.hift.upsample_rates) == hift["upsample_rates"]
    assert tiny.mel.fmax == dims["feat_extractor"]["fmax"] and tiny.mel.n_fft == dims["feat_extractor"]["n_fft"]


def test_tiny_matches_the_oracle_dims():
    """ModelConfig.tiny() is what the flow / HiFT oracle's official modules were built with."""
    _check_tiny_dims(json.loads((FLOW_ORACLE / "cosyvoice2_dims.json").read_text()))


def test_tiny_matches_the_external_reference_dims(external_tiny_dir):
    _check_tiny_dims(json.loads((external_tiny_dir / "cosyvoice2_dims.json").read_text()))
