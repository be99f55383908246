"""``cosyvoice3.yaml``: the dims of the three CosyVoice3 modules and the prompt-mel extractor, read and written.

:func:`read_cosyvoice3_yaml` reads the released file (or one :func:`write_cosyvoice3_yaml` wrote) without executing
its tags: the ``llm`` section as :class:`~cosyvoice_triton.config.LLMConfig` (for
:func:`~.llm.load_llm3`), ``flow`` as :class:`~.flow.Flow3Dims` (:func:`~.flow.load_flow3`), ``hift`` as
:class:`~.hift.Hift3Dims` (:func:`~.hift.load_hift3`), ``feat_extractor`` as
:class:`~cosyvoice_triton.config.MelConfig`. CosyVoice3's prompt mel has no upper band limit (``fmax: null``),
where CosyVoice2's stops at 8 kHz.

:func:`write_cosyvoice3_yaml` writes the official file's structure (the model sections of
``examples/libritts/cosyvoice3/conf/cosyvoice3.yaml``, same classes, keys and ``!ref`` links) at the given dims,
without the training sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import (
    CFMConfig,
    LLMConfig,
    MelConfig,
    _llm_config_from_doc,
    _llm_yaml,
    _pick,
    cfm_yaml,
    flow_yaml_fields,
    header_yaml,
    hift_yaml_fields,
    load_hyperpyyaml,
    mel_yaml,
)
from ...errors import ConfigError
from ...family import COSYVOICE3, FAMILY_YAML, yaml_classes_family
from .dit import DiTDims
from .flow import Flow3Dims
from .hift import Hift3Dims

YAML_NAME = FAMILY_YAML[COSYVOICE3]


@dataclass(frozen=True)
class CosyVoice3Config:
    """What ``cosyvoice3.yaml`` says about the model (defaults: the Fun-CosyVoice3-0.5B release)."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: Flow3Dims = field(default_factory=Flow3Dims)
    hift: Hift3Dims = field(default_factory=Hift3Dims)
    mel: MelConfig = field(default_factory=lambda: MelConfig(fmax=None))
    sample_rate: int = 24000
    token_frame_rate: int = 25

    @classmethod
    def full(cls) -> CosyVoice3Config:
        return cls()

    @classmethod
    def tiny(cls) -> CosyVoice3Config:
        """The test dims of each module (:meth:`Flow3Dims.tiny`, :meth:`Hift3Dims.tiny`, a 64-wide LM)."""
        return cls(llm=LLMConfig.tiny(), flow=Flow3Dims.tiny(), hift=Hift3Dims.tiny())

    @property
    def chunk_size(self) -> int:
        """Streaming chunk in speech tokens (the yaml's ``chunk_size``; the DiT's chunk is this times
        ``token_mel_ratio`` mel frames)."""
        return self.flow.dit.static_chunk_size // self.flow.token_mel_ratio


def read_cosyvoice3_yaml(path: str | Path) -> CosyVoice3Config:
    """The :class:`CosyVoice3Config` of a ``cosyvoice3.yaml`` (a file, or the model folder holding it); refuses a
    yaml whose llm / flow / hift classes are not CosyVoice3's, naming the file and the section."""
    path = Path(path)
    if path.is_dir():
        path = path / YAML_NAME
    family = yaml_classes_family(path)
    if family != COSYVOICE3:
        raise ConfigError(f"{path}: builds {family} modules, not CosyVoice3's")
    doc = load_hyperpyyaml(path.read_text(encoding="utf-8"))
    try:
        llm = _llm_config_from_doc(doc["llm"])
        flow = _flow_dims(doc["flow"])
        hift = Hift3Dims.from_section(doc["hift"])
        mel = _pick(MelConfig, doc["feat_extractor"])
        return CosyVoice3Config(llm=llm, flow=flow, hift=hift, mel=mel, sample_rate=int(doc["sample_rate"]),
                                token_frame_rate=int(doc.get("token_frame_rate", 25)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path}: unexpected CosyVoice3 yaml: {exc!r}") from exc


def _flow_dims(flow: dict[str, Any]) -> Flow3Dims:
    decoder = flow["decoder"]
    estimator = decoder["estimator"]
    if not str(estimator.get("__class__", "")).endswith("DiT"):
        raise ValueError(f"flow.decoder.estimator is {estimator.get('__class__')}, not cosyvoice.flow.DiT.dit.DiT")
    cfm = decoder.get("cfm_params", {}).get("content", {})
    lookahead = flow.get("pre_lookahead_layer", {})
    return _pick(
        Flow3Dims, flow,
        pre_lookahead_channels=int(lookahead.get("channels", Flow3Dims.pre_lookahead_channels)),
        dit=_pick(DiTDims, estimator),
        cfm=_pick(CFMConfig, cfm),
    )


def write_cosyvoice3_yaml(config: CosyVoice3Config, path: str | Path) -> Path:
    """Write ``config`` as a ``cosyvoice3.yaml`` in the official structure; returns ``path``. Refuses dims the
    official file cannot express (values it does not carry, or that the ``!ref`` links tie together)."""
    llm, f, d, h, mel = config.llm, config.flow, config.flow.dit, config.hift, config.mel
    defaults = DiTDims()
    fixed = {k: (getattr(d, k), getattr(defaults, k)) for k in ("time_freq_dim", "conv_pos_kernel", "conv_pos_groups")}
    problems = [f"dit.{k} {v} (the yaml has no key for it: {default})" for k, (v, default) in fixed.items()
                if v != default]
    if d.static_chunk_size % f.token_mel_ratio:
        problems.append(f"dit.static_chunk_size {d.static_chunk_size} is not chunk_size * token_mel_ratio "
                        f"{f.token_mel_ratio}")
    if (llm.llm_input_size, f.cfm.n_timesteps) != (llm.llm_output_size, CFMConfig.n_timesteps):
        problems.append("llm_input_size != llm_output_size or cfm.n_timesteps is not 10")
    if h.sampling_rate != config.sample_rate or mel.sampling_rate != config.sample_rate:
        problems.append(f"hift / mel sampling rates {h.sampling_rate} / {mel.sampling_rate} differ from "
                        f"sample_rate {config.sample_rate}")
    if problems:
        raise ConfigError("cannot write as cosyvoice3.yaml: " + "; ".join(problems))
    text = f"""\
# Written by cosyvoice_triton. The model sections of Fun-CosyVoice3-0.5B's cosyvoice3.yaml (same classes, keys and
# links), at these dims.
{header_yaml(config.sample_rate, llm, f.spk_embed_dim, config.token_frame_rate, f.token_mel_ratio)}\

# stream related params
chunk_size: {config.chunk_size}
num_decoding_left_chunks: {d.num_decoding_left_chunks}

{_llm_yaml(llm, "cosyvoice.llm.llm.CosyVoice3LM").lstrip()}
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
{flow_yaml_fields(f)}\
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {f.input_size}
        channels: {f.pre_lookahead_channels}
        pre_lookahead_len: {f.pre_lookahead_len}
{cfm_yaml(f.cfm, d.spk_dim)}\
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {d.dim}
            depth: {d.depth}
            heads: {d.heads}
            dim_head: {d.dim_head}
            ff_mult: {d.ff_mult}
            mel_dim: {d.mel_dim}
            mu_dim: {d.mu_dim}
            spk_dim: {d.spk_dim}
            out_channels: {d.out_channels}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
{hift_yaml_fields(h)}\
    conv_pre_look_right: {h.conv_pre_look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: {h.f0_num_class}
        in_channels: {h.f0_in_channels}
        cond_channels: {h.f0_cond_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
{mel_yaml(mel)}"""
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path
