"""Which family a model folder is (the official ``AutoModel`` rule) and the files a CosyVoice3 folder needs."""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice_triton.config import LLMConfig, ModelConfig, write_yaml
from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.family import (
    COSYVOICE3_FILES,
    check_model_folder,
    missing_files,
    model_family,
    yaml_classes_family,
)


def _folder(tmp_path, *names: str):
    d = tmp_path / "model"
    d.mkdir()
    for name in names:
        if name.endswith("/"):
            (d / name).mkdir()
        else:
            (d / name).write_text("")
    return d


@pytest.mark.parametrize(("yamls", "family"), [
    (["cosyvoice3.yaml"], "cosyvoice3"),
    (["cosyvoice2.yaml"], "cosyvoice2"),
    (["cosyvoice.yaml"], "cosyvoice"),
    # AutoModel tries cosyvoice.yaml, then cosyvoice2.yaml, then cosyvoice3.yaml: the first present wins
    (["cosyvoice2.yaml", "cosyvoice3.yaml"], "cosyvoice2"),
    (["cosyvoice.yaml", "cosyvoice3.yaml"], "cosyvoice"),
])
def test_family_from_the_yaml_present(tmp_path, yamls, family):
    assert model_family(_folder(tmp_path, *yamls, "llm.pt")) == family


def test_folder_without_a_yaml_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="none of cosyvoice.yaml, cosyvoice2.yaml, cosyvoice3.yaml"):
        model_family(_folder(tmp_path, "llm.pt", "cosyvoice3.yml", "CosyVoice-BlankEN/"))
    with pytest.raises(ConfigError, match="not a folder"):
        model_family(tmp_path / "absent")
    (tmp_path / "cosyvoice3.yaml").mkdir()  # a folder of that name is no yaml
    with pytest.raises(ConfigError, match="none of"):
        model_family(tmp_path)


def test_cosyvoice3_files(tmp_path):
    assert COSYVOICE3_FILES == ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                                "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/")
    d = _folder(tmp_path, *COSYVOICE3_FILES)
    assert missing_files(d, "cosyvoice3") == []
    assert check_model_folder(d) == check_model_folder(d, "cosyvoice3") == "cosyvoice3"
    (d / "speech_tokenizer_v3.onnx").unlink()
    (d / "CosyVoice-BlankEN").rmdir()
    (d / "CosyVoice-BlankEN").write_text("")  # a file where the folder belongs
    assert missing_files(d, "cosyvoice3") == ["speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/"]
    with pytest.raises(ConfigError, match="without speech_tokenizer_v3.onnx, CosyVoice-BlankEN/"):
        check_model_folder(d)


def test_cosyvoice2_folder_is_not_cosyvoice3(tmp_path):
    d = _folder(tmp_path, "cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/")
    assert check_model_folder(d) == "cosyvoice2"
    assert missing_files(d, "cosyvoice3") == ["cosyvoice3.yaml", "speech_tokenizer_v3.onnx"]
    with pytest.raises(ConfigError, match="a cosyvoice2 folder .*, not cosyvoice3"):
        check_model_folder(d, "cosyvoice3")
    with pytest.raises(ConfigError, match="unknown model family"):
        missing_files(d, "cosyvoice4")


def _classes_yaml(path, llm: str, flow: str, hift: str):
    path.write_text(f"llm: !new:cosyvoice.llm.llm.{llm}\n    speech_token_size: 6561\n"
                    f"flow: !new:cosyvoice.flow.flow.{flow}\n    input_size: 80\n"
                    f"hift: !new:cosyvoice.hifigan.generator.{hift}\n    in_channels: 80\n")
    return path


def test_yaml_classes_decide_the_family_as_get_model_type(tmp_path):
    v3 = ("CosyVoice3LM", "CausalMaskedDiffWithDiT", "CausalHiFTGenerator")
    assert yaml_classes_family(_classes_yaml(tmp_path / "cosyvoice3.yaml", *v3)) == "cosyvoice3"
    write_yaml(dataclasses.replace(ModelConfig.tiny(), llm=LLMConfig.tiny()), tmp_path / "cosyvoice2.yaml")
    assert yaml_classes_family(tmp_path / "cosyvoice2.yaml") == "cosyvoice2"
    # isinstance rules: a CosyVoice3LM is a Qwen2LM, a CausalHiFTGenerator a HiFTGenerator
    mixed = _classes_yaml(tmp_path / "other.yaml", "CosyVoice3LM", "CausalMaskedDiffWithXvec", "CausalHiFTGenerator")
    assert yaml_classes_family(mixed) == "cosyvoice2"
    v1 = _classes_yaml(tmp_path / "v1.yaml", "TransformerLM", "MaskedDiffWithXvec", "HiFTGenerator")
    assert yaml_classes_family(v1) == "cosyvoice"


def test_yaml_of_another_family_is_refused(tmp_path):
    wrong = _classes_yaml(tmp_path / "cosyvoice3.yaml", "Qwen2LM", "CausalMaskedDiffWithXvec", "HiFTGenerator")
    with pytest.raises(ConfigError, match="builds cosyvoice2 modules .*, not cosyvoice3's"):
        yaml_classes_family(wrong)
    # a Qwen2LM is no CosyVoice3LM, a HiFTGenerator no CausalHiFTGenerator
    none = _classes_yaml(tmp_path / "x.yaml", "Qwen2LM", "CausalMaskedDiffWithDiT", "CausalHiFTGenerator")
    with pytest.raises(ConfigError, match="no model type found"):
        yaml_classes_family(none)
    with pytest.raises(ConfigError, match="no such file"):
        yaml_classes_family(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("llm: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        yaml_classes_family(tmp_path / "bad.yaml")
