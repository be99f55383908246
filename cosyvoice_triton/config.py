"""Model dimensions, read from a CosyVoice2 model folder's ``cosyvoice2.yaml``.

The official yaml is a HyperPyYAML file: ``!new:``/``!name:``/``!apply:`` tags build Python objects and
``!ref <key>`` (optionally with arithmetic, ``!ref <chunk_size> * <token_mel_ratio>``) refers to other
keys. We never execute it: tags become plain mappings and references are resolved to numbers with a
small arithmetic evaluator. Only the numbers the inference code needs are kept, in frozen dataclasses.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

# ----------------------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoder`` (rel-pos conformer, x2 upsample). ``output_size`` is hard-wired to 512
    in the official code's up-sampling layers, so only heads, FFN width and depth vary."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    static_chunk_size: int = 25
    pre_lookahead_len: int = 3
    upsample_stride: int = 2


@dataclass(frozen=True)
class EstimatorConfig:
    """``CausalConditionalDecoder``, the U-Net-like transformer that predicts the flow's velocity."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1


@dataclass(frozen=True)
class CFMConfig:
    """The conditional flow-matching solver (Euler, cosine schedule, classifier-free guidance)."""

    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    n_timesteps: int = 10
    noise_frames: int = 15000


@dataclass(frozen=True)
class FlowConfig:
    """``CausalMaskedDiffWithXvec``: speech tokens + prompt mel + speaker embedding to mel."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True)
class F0PredictorConfig:
    in_channels: int = 80
    cond_channels: int = 512
    num_class: int = 1


@dataclass(frozen=True)
class HiftConfig:
    """``HiFTGenerator``: neural source filter + iSTFT vocoder, mel (80 x T) to 24 kHz audio (480 T)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_predictor: F0PredictorConfig = field(default_factory=F0PredictorConfig)

    @property
    def upsample_factor(self) -> int:
        """Output samples per mel frame (480 for the release: 8*5*3 upsampling times the iSTFT hop)."""
        n = self.hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelConfig:
    """``matcha.utils.audio.mel_spectrogram`` parameters of the flow's 80-bin mel (the feat_extractor)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0
    center: bool = False


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (``ras_sampling``): nucleus sampling within ``top_p`` mass and ``top_k`` tokens;
    a token already seen at least ``win_size * tau_r`` times in the last ``win_size`` is re-drawn from the full
    distribution without it."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LLMConfig:
    """``Qwen2LM``, text tokens to speech tokens. The Qwen2 transformer's own dims come from
    ``CosyVoice-BlankEN/config.json``; ``llm_input_size`` / ``llm_output_size`` must equal its hidden size."""

    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    mix_ratio: tuple[int, ...] = (5, 15)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @classmethod
    def full(cls) -> LLMConfig:
        return cls()

    @classmethod
    def tiny(cls) -> LLMConfig:
        """The dims of the tiny Qwen2 stand-in (hidden size 64; the speech vocabulary stays the flow's 6561)."""
        return cls(llm_input_size=64, llm_output_size=64)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the token-to-waveform path needs; ``ModelConfig()`` is CosyVoice2-0.5B."""

    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    chunk_size: int = 25
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)
    mel: MelConfig = field(default_factory=MelConfig)
    llm: LLMConfig | None = None  # filled when the yaml has an llm section

    @classmethod
    def full(cls) -> ModelConfig:
        """The CosyVoice2-0.5B release dims."""
        return cls()

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The small dims of the flow / HiFT test oracle (same tensor interfaces as full)."""
        return cls(
            flow=FlowConfig(
                encoder=EncoderConfig(attention_heads=2, linear_units=64, num_blocks=1),
                estimator=EstimatorConfig(
                    channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=2
                ),
            ),
            hift=HiftConfig(base_channels=64, f0_predictor=F0PredictorConfig(cond_channels=64)),
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        """Read the numbers of an official ``cosyvoice2.yaml`` without executing any of its tags."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (a CosyVoice2 model folder has cosyvoice2.yaml)")
        try:
            doc = load_hyperpyyaml(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, ConfigError) as exc:
            raise ConfigError(f"{path}: cannot parse: {exc}") from exc
        try:
            return _model_config_from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: unexpected structure: {exc!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ hyperpyyaml, inertly


class _Ref:
    __slots__ = ("expr",)

    def __init__(self, expr: str):
        self.expr = expr


class _InertLoader(yaml.SafeLoader):
    """SafeLoader that turns every HyperPyYAML tag into data instead of objects."""


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = loader.construct_mapping(node, deep=True)
        return {"__class__": suffix, **out}
    if isinstance(node, yaml.SequenceNode):
        return {"__class__": suffix, "__args__": loader.construct_sequence(node, deep=True)}
    return {"__class__": suffix, "__args__": loader.construct_scalar(node)}


def _construct_ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


for _tag in ("!new:", "!name:", "!apply:", "!module:"):
    _InertLoader.add_multi_constructor(_tag, _construct_tagged)
_InertLoader.add_constructor("!ref", _construct_ref)
_InertLoader.add_multi_constructor("!", _construct_tagged)  # any other local tag: data too

_REF_RE = re.compile(r"<([^<>]+)>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _eval_arith(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arith(node.operand)
    raise ConfigError(f"unsupported expression in !ref: {ast.dump(node)}")


def load_hyperpyyaml(text: str) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data; ``!ref`` values are resolved, tags kept as ``__class__``."""
    doc = yaml.load(text, Loader=_InertLoader)
    if not isinstance(doc, dict):
        raise ConfigError("top level is not a mapping")

    def lookup(key: str, stack: tuple[str, ...]) -> Any:
        node: Any = doc
        for part in key.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"!ref <{key}> names no key")
            node = node[part]
        return resolve(node, (*stack, key))

    def resolve(node: Any, stack: tuple[str, ...] = ()) -> Any:
        if isinstance(node, _Ref):
            refs = _REF_RE.findall(node.expr)
            if any(r in stack for r in refs):
                raise ConfigError(f"circular !ref {node.expr}")
            if len(refs) == 1 and node.expr.strip() == f"<{refs[0]}>":
                return lookup(refs[0], stack)
            values = {r: lookup(r, stack) for r in refs}
            expr = _REF_RE.sub(lambda m: repr(values[m.group(1)]), node.expr)
            try:
                return _eval_arith(ast.parse(expr, mode="eval"))
            except SyntaxError as exc:
                raise ConfigError(f"cannot evaluate !ref {node.expr!r}") from exc
        if isinstance(node, dict):
            return {k: resolve(v, stack) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, stack) for v in node]
        return node

    return resolve(doc)


def _tuples(value: Any) -> Any:
    """A yaml list (and the lists in it, e.g. dilation sizes) as tuples, for the frozen dataclasses."""
    if not isinstance(value, list):
        return value
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def _pick(cls: type, section: dict[str, Any], **overrides: Any) -> Any:
    """Build dataclass ``cls`` from the keys of ``section`` that it declares (``overrides`` win); the rest
    keep defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: _tuples(v) for k, v in section.items() if k in names}
    return cls(**{**kwargs, **overrides})


def _model_config_from_doc(doc: dict[str, Any]) -> ModelConfig:
    flow = doc["flow"]
    enc = flow["encoder"]
    dec = flow["decoder"]
    est = dec["estimator"]
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm)
    hift = doc["hift"]
    istft = hift.get("istft_params", {})
    mel = doc.get("feat_extractor", {})
    return ModelConfig(
        sample_rate=int(doc.get("sample_rate", 24000)),
        token_frame_rate=int(doc.get("token_frame_rate", 25)),
        token_mel_ratio=int(doc.get("token_mel_ratio", 2)),
        chunk_size=int(doc.get("chunk_size", 25)),
        flow=_pick(
            FlowConfig, flow,
            encoder=_pick(EncoderConfig, enc, pre_lookahead_len=int(flow.get("pre_lookahead_len", 3))),
            estimator=_pick(EstimatorConfig, est),
            cfm=_pick(CFMConfig, cfm),
        ),
        hift=_pick(
            HiftConfig, hift,
            n_fft=int(istft.get("n_fft", 16)),
            hop_len=int(istft.get("hop_len", 4)),
            f0_predictor=_pick(F0PredictorConfig, hift.get("f0_predictor", {})),
        ),
        mel=_pick(MelConfig, mel),
        llm=_llm_config_from_doc(doc["llm"]) if "llm" in doc else None,
    )


def _llm_config_from_doc(llm: dict[str, Any]) -> LLMConfig:
    sampling = llm.get("sampling", {})
    name = sampling.get("__class__", "cosyvoice.utils.common.ras_sampling")
    if not name.endswith("ras_sampling"):
        raise ValueError(f"llm.sampling is {name}; only cosyvoice.utils.common.ras_sampling is implemented")
    return _pick(LLMConfig, llm, sampling=_pick(SamplingConfig, sampling))


def write_yaml(config: ModelConfig, path: str | Path) -> None:
    """Write ``config`` as a ``cosyvoice2.yaml`` in the official layout (tags included) for demo models."""
    f, e, d, h = config.flow, config.flow.encoder, config.flow.estimator, config.hift
    seq = lambda xs: "[" + ", ".join(str(x) for x in xs) + "]"
    llm = config.llm or LLMConfig()
    text = f"""\
# Written by cosyvoice_triton (demo model, random weights). Same structure as the CosyVoice2-0.5B release.
{header_yaml(config.sample_rate, llm, f.spk_embed_dim, config.token_frame_rate, config.token_mel_ratio)}\
chunk_size: {config.chunk_size}
num_decoding_left_chunks: {d.num_decoding_left_chunks}
{_llm_yaml(config.llm)}
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
{flow_yaml_fields(f)}\
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {e.input_size}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
{cfm_yaml(f.cfm, 80)}\
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {d.in_channels}
            out_channels: {d.out_channels}
            channels: {seq(d.channels)}
            dropout: 0.0
            attention_head_dim: {d.attention_head_dim}
            n_blocks: {d.n_blocks}
            num_mid_blocks: {d.num_mid_blocks}
            num_heads: {d.num_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
{hift_yaml_fields(h)}\
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: {h.f0_predictor.num_class}
        in_channels: {h.f0_predictor.in_channels}
        cond_channels: {h.f0_predictor.cond_channels}

{mel_yaml(config.mel)}"""
    Path(path).write_text(text, encoding="utf-8")


def header_yaml(sample_rate: int, llm: LLMConfig, spk_embed_dim: int, token_frame_rate: int,
                token_mel_ratio: int) -> str:
    """The official yamls' first top-level values (``sample_rate`` to ``token_mel_ratio``), which their sections
    refer to with ``!ref``."""
    return f"""\
sample_rate: {sample_rate}
llm_input_size: {llm.llm_input_size}
llm_output_size: {llm.llm_output_size}
spk_embed_dim: {spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {token_frame_rate}
token_mel_ratio: {token_mel_ratio}
"""


def cfm_yaml(cfm: CFMConfig, spk_emb_dim: int) -> str:
    """The ``decoder:`` key of the official yamls' ``flow:`` section up to its estimator: the
    ``CausalConditionalCFM`` and its ``cfm_params`` (lines indented by 4)."""
    return f"""\
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {spk_emb_dim}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: '{cfm.t_scheduler}'
                training_cfg_rate: 0.2
                inference_cfg_rate: {cfm.inference_cfg_rate}
                reg_loss_type: 'l1'
"""


def hift_yaml_fields(h: Any) -> str:
    """The keys of the official yamls' ``hift:`` section that CosyVoice2's and CosyVoice3's vocoders share, from a
    :class:`HiftConfig` or a ``Hift3Dims`` (lines indented by 4, the last one ending the text)."""
    seq = lambda xs: "[" + ", ".join(str(x) for x in xs) + "]"
    return f"""\
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {h.nsf_alpha}
    nsf_sigma: {h.nsf_sigma}
    nsf_voiced_threshold: {h.nsf_voiced_threshold}
    upsample_rates: {seq(h.upsample_rates)}
    upsample_kernel_sizes: {seq(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.n_fft}
        hop_len: {h.hop_len}
    resblock_kernel_sizes: {seq(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: {seq(seq(x) for x in h.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {seq(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {seq(seq(x) for x in h.source_resblock_dilation_sizes)}
    lrelu_slope: {h.lrelu_slope}
    audio_limit: {h.audio_limit}
"""


def mel_yaml(mel: MelConfig) -> str:
    """The official yamls' ``feat_extractor:`` section (the flow's prompt mel) for ``mel``."""
    return f"""\
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {mel.n_fft}
    num_mels: {mel.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {mel.hop_size}
    win_size: {mel.win_size}
    fmin: {mel.fmin:g}
    fmax: {"null" if mel.fmax is None else f"{mel.fmax:g}"}
    center: {mel.center}
"""


def flow_yaml_fields(f: Any) -> str:
    """The first keys of the official yamls' ``flow:`` section, the same in CosyVoice2's and CosyVoice3's, from a
    :class:`FlowConfig` or a ``Flow3Dims`` (lines indented by 4)."""
    return f"""\
    input_size: {f.input_size}
    output_size: {f.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {f.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {f.pre_lookahead_len}
"""


def _llm_yaml(llm: LLMConfig | None, cls: str = "cosyvoice.llm.llm.Qwen2LM") -> str:
    """The official yamls' ``llm:`` section (after a blank line) building ``cls``, or nothing for ``None``."""
    if llm is None:
        return ""
    s = llm.sampling
    return f"""
llm: !new:{cls}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {llm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [{", ".join(str(x) for x in llm.mix_ratio)}]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {s.top_p}
        top_k: {s.top_k}
        win_size: {s.win_size}
        tau_r: {s.tau_r}
"""
