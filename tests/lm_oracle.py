"""The LM oracle (tests/fixtures/llm_oracle, made by tests/oracle/make_llm_oracle.py) as the LM tests read it: its
folders, metadata, cases and model config, the oracle script itself, the full-size ``llm.pt`` regenerated from its
seeds, the injected draws as a counting callable, and one served TTS request's inputs."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, ROOT

from cosyvoice_triton.config import LLMConfig, ModelConfig

ORACLE = FIXTURES / "llm_oracle"
ORACLE_FULL = ORACLE / "full"


@functools.cache
def oracle_script():
    """tests/oracle/make_llm_oracle.py as a module (its seeded weights, digests and ``pick``)."""
    spec = importlib.util.spec_from_file_location("make_llm_oracle", ROOT / "tests" / "oracle" / "make_llm_oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle_meta(folder: Path = ORACLE) -> dict:
    return json.loads((folder / "oracle_meta.json").read_text())


def oracle_cases(folder: Path = ORACLE) -> dict[str, dict[str, np.ndarray]]:
    """Case name -> its arrays (``lm_<name>.npz``: inputs, uniforms, tokens, log-probabilities)."""
    out = {}
    for path in sorted(folder.glob("lm_*.npz")):
        with np.load(path) as z:
            out[path.stem.removeprefix("lm_")] = {k: z[k] for k in z.files}
    return out


def oracle_config(folder: Path = ORACLE) -> ModelConfig:
    """The tiny model config with the oracle LM's width."""
    hidden = oracle_meta(folder)["qwen_config"]["hidden_size"]
    return dataclasses.replace(ModelConfig.tiny(), llm=LLMConfig(llm_input_size=hidden, llm_output_size=hidden))


def full_llm_dir(tmp_path_factory, name: str) -> Path:
    """A folder with the full-size ``llm.pt``, regenerated the oracle's seeded way (2 GB, not committed) and checked
    by digest, and its tokenizer; skips the calling test where the full-size references are absent."""
    if not (ORACLE_FULL / "oracle_meta.json").is_file():
        pytest.skip(f"full-size references {ORACLE_FULL} are absent")
    meta, oracle = oracle_meta(ORACLE_FULL), oracle_script()
    state = oracle.random_llm_state_dict(meta["qwen_config"], seed=meta["seeds"]["weights"])
    assert oracle.state_digest(state) == meta["weights"]["state_sha256"], "regenerated weights differ from the oracle's"
    d = tmp_path_factory.mktemp(name)
    torch.save(state, d / "llm.pt")
    del state
    shutil.copytree(ORACLE_FULL / "CosyVoice-BlankEN", d / "CosyVoice-BlankEN")
    return d


class CountedDraws:
    """A case's uniforms as a draw callable that counts what it hands out."""

    def __init__(self, draws):
        self.values, self.used = np.asarray(draws).tolist(), 0

    def __call__(self) -> float:
        self.used += 1
        return self.values[self.used - 1]


def tts_request(serving_assets) -> tuple[Path, dict, np.ndarray, dict[str, np.ndarray]]:
    """The served TTS service's inputs on the session's tiny model: its folder, the fp32 graphs as callables, a
    1 s prompt waveform (24 kHz) and one request's tensors (text, that prompt with its transcript, a seed)."""
    from cosyvoice_triton.serving.stages.graphs import GraphRunner
    from cosyvoice_triton.shapes import GRAPHS

    onnx = serving_assets["onnx_dir"] / "fp32"
    graphs = {g: GraphRunner(g, onnx_path=onnx / f"{g}.onnx").run for g in GRAPHS}
    wave = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    inputs = {"text": np.array([[b"Hello there, this is a test."]], object), "prompt_audio": wave[None],
              "prompt_sample_rate": np.array([[24000]], np.int32),
              "prompt_text": np.array([[b"the prompt"]], object), "seed": np.array([[3]], np.int64)}
    return serving_assets["model_dir"], graphs, wave, inputs
