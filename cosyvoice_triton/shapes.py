"""The one shape spec: every exported graph's tensor names, dtypes and min/opt/max dimensions.

ONNX export (dynamic axes, verification shapes), TensorRT optimisation profiles and Triton model configs
are all derived from :data:`GRAPHS`; nothing else in the project spells a graph's shapes.

A dimension is an ``int`` (fixed), an axis name (``"batch"``, ``"mel_frames"``...) or ``(axis, factor)``
for a multiple of an axis (HiFT's ``480 * mel_frames`` samples). Every tensor's first dimension is the
batch axis. Axis ranges are :class:`AxisRange` (min, opt, max); ``opt`` is what TensorRT tunes for.

Lengths: 30 s of audio is the speech tokenizer's limit, so a prompt and a source of 30 s each give at most
1500 tokens and 3000 mel frames through the flow; the vocoder sees at most the source's 1500 frames plus
the 8 frames of streaming context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

Dim = int | str | tuple[str, int]

SAMPLES_PER_MEL_FRAME = 480  # HiFT: 8 * 5 * 3 upsampling * iSTFT hop 4, at 24 kHz
NSF_HARMONICS = 9  # nb_harmonics + 1 sine channels of the NSF source noise


@dataclass(frozen=True)
class AxisRange:
    min: int
    opt: int
    max: int

    def __post_init__(self):
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"axis range needs 1 <= min <= opt <= max, got {self}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor. ``values``: the inclusive range of an integer input's values (token ids, look-ahead counts);
    ``length_of``: the axis whose per-item length a rank-1 integer input gives (each value in 1..that axis's
    size in the request). Runners check both per request, before batching."""

    name: str
    dtype: str  # numpy / ONNX spelling: float32, int32, bool
    shape: tuple[Dim, ...]
    values: tuple[int, int] | None = None
    length_of: str | None = None

    def dim_names(self) -> list[str | int]:
        """ONNX ``dynamic_axes`` style names: an axis name, ``"480*mel_frames"``, or a fixed int."""
        return [d if isinstance(d, (int, str)) else f"{d[1]}*{d[0]}" for d in self.shape]


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    axes: Mapping[str, AxisRange] = field(default_factory=dict)
    doc: str = ""

    def tensor(self, name: str) -> TensorSpec:
        for t in (*self.inputs, *self.outputs):
            if t.name == name:
                return t
        raise KeyError(f"{self.name} has no tensor {name!r}")

    def resolve(self, tensor: TensorSpec | str, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Concrete shape of ``tensor`` for the given axis sizes."""
        t = self.tensor(tensor) if isinstance(tensor, str) else tensor
        out = []
        for d in t.shape:
            if isinstance(d, int):
                out.append(d)
            elif isinstance(d, str):
                out.append(int(sizes[d]))
            else:
                out.append(int(sizes[d[0]]) * d[1])
        return tuple(out)

    def profile(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """TensorRT optimisation profile: input name -> (min, opt, max) shape."""
        pick = lambda which: {k: getattr(r, which) for k, r in self.axes.items()}
        return {t.name: (self.resolve(t, pick("min")), self.resolve(t, pick("opt")), self.resolve(t, pick("max")))
                for t in self.inputs}

    def triton_dims(self, tensor: TensorSpec | str) -> list[int]:
        """Triton ``dims`` (without the batch axis): fixed sizes, -1 for dynamic ones."""
        t = self.tensor(tensor) if isinstance(tensor, str) else tensor
        return [d if isinstance(d, int) else -1 for d in t.shape[1:]]

    @property
    def max_batch_size(self) -> int:
        return self.axes["batch"].max


def _t(name: str, dtype: str, *shape: Dim, values: tuple[int, int] | None = None,
       length_of: str | None = None) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape), values, length_of)


#: CosyVoice2's speech-token vocabulary (the v2 tokenizer's 3^8 codes; the flow's embedding table).
SPEECH_TOKEN_VOCAB = 6561
#: The look-ahead tokens of a streaming chunk (the flow's pre-lookahead layer; 0 when not streaming).
MAX_LOOKAHEAD = 3


_B = "batch"
_MEL = "mel_frames"

GRAPHS: Mapping[str, GraphSpec] = MappingProxyType({
    "speech_tokenizer": GraphSpec(
        "speech_tokenizer",
        inputs=(_t("whisper_mel", "float32", _B, 128, "whisper_frames"),
                _t("whisper_mel_len", "int32", _B, length_of="whisper_frames")),
        outputs=(_t("speech_tokens", "int32", _B, "tokens"),),
        axes={_B: AxisRange(1, 4, 16), "whisper_frames": AxisRange(10, 500, 3000),
              "tokens": AxisRange(3, 125, 750)},
        doc="speech_tokenizer_v2.onnx as shipped, I/O renamed: 100 Hz Whisper log-mel -> 25 Hz tokens",
    ),
    "speaker_encoder": GraphSpec(
        "speaker_encoder",
        inputs=(_t("fbank", "float32", _B, "fbank_frames", 80),),
        outputs=(_t("speaker_embedding", "float32", _B, 192),),
        axes={_B: AxisRange(1, 4, 16), "fbank_frames": AxisRange(8, 300, 3000)},
        doc="campplus.onnx as shipped, I/O renamed: mean-normalised Kaldi fbank -> CAM++ x-vector",
    ),
    "flow_encoder": GraphSpec(
        "flow_encoder",
        inputs=(
            # prompt tokens then source tokens, per item
            _t("speech_tokens", "int32", _B, "tokens", values=(0, SPEECH_TOKEN_VOCAB - 1)),
            _t("speech_token_len", "int32", _B, length_of="tokens"),
            # trailing tokens that are look-ahead only (0 or 3)
            _t("lookahead_len", "int32", _B, values=(0, MAX_LOOKAHEAD)),
            _t("speaker_embedding", "float32", _B, 192),
            _t("streaming", "bool", _B),
        ),
        outputs=(
            _t("mu", "float32", _B, 80, ("tokens", 2)),
            _t("mel_len", "int32", _B),
            _t("spks", "float32", _B, 80),
        ),
        axes={_B: AxisRange(1, 4, 16), "tokens": AxisRange(4, 200, 1500)},
        doc="token embedding, UpsampleConformerEncoder, encoder_proj, speaker projection",
    ),
    "flow_estimator": GraphSpec(
        "flow_estimator",
        inputs=(
            _t("x", "float32", _B, 80, _MEL),
            _t("mask", "float32", _B, 1, _MEL),
            _t("mu", "float32", _B, 80, _MEL),
            _t("t", "float32", _B),
            _t("spks", "float32", _B, 80),
            _t("cond", "float32", _B, 80, _MEL),
            _t("streaming", "bool", _B),
        ),
        outputs=(_t("velocity", "float32", _B, 80, _MEL),),
        # batch counts CFG rows: 2 per utterance
        axes={_B: AxisRange(2, 8, 32), _MEL: AxisRange(4, 500, 3000)},
        doc="CausalConditionalDecoder: one Euler step's velocity for conditional + unconditional rows",
    ),
    "hift_source": GraphSpec(
        "hift_source",
        inputs=(
            _t("mel", "float32", _B, 80, _MEL),
            _t("nsf_noise", "float32", _B, (_MEL, SAMPLES_PER_MEL_FRAME), NSF_HARMONICS),
        ),
        outputs=(_t("source", "float32", _B, 1, (_MEL, SAMPLES_PER_MEL_FRAME)),),
        axes={_B: AxisRange(1, 4, 16), _MEL: AxisRange(4, 250, 1508)},
        doc="F0 predictor + NSF sine source (phase accumulation: fp32 only)",
    ),
    "hift_decoder": GraphSpec(
        "hift_decoder",
        inputs=(
            _t("mel", "float32", _B, 80, _MEL),
            _t("source", "float32", _B, 1, (_MEL, SAMPLES_PER_MEL_FRAME)),
        ),
        outputs=(_t("waveform", "float32", _B, (_MEL, SAMPLES_PER_MEL_FRAME)),),
        axes={_B: AxisRange(1, 4, 16), _MEL: AxisRange(4, 250, 1508)},
        doc="HiFT generator: source STFT, upsampling ResBlocks, exp/sin spectrum, conv iSTFT, clamp",
    ),
})


_SEQ = "seq_len"
# CosyVoice2's estimator inputs without ``streaming``, the time axis named as the official export names it
_DIT_INPUTS = tuple(replace(t, shape=tuple(_SEQ if d == _MEL else d for d in t.shape))
                    for t in GRAPHS["flow_estimator"].inputs if t.name != "streaming")
_DIT_OUTPUTS = (_t("estimator_out", "float32", _B, 80, _SEQ),)
# batch counts CFG rows (2 per utterance); seq_len: the official TensorRT profile's 4 / 500 / 3000 frames
_DIT_AXES = {_B: AxisRange(2, 8, 32), _SEQ: AxisRange(4, 500, 3000)}
_HIFT3_AXES = {_B: AxisRange(1, 4, 16), _MEL: AxisRange(4, 250, 1500)}

#: CosyVoice3's graphs (``export/onnx_export3.py``), apart from :data:`GRAPHS`: the DiT estimator under the official
#: export's tensor names (``x, mask, mu, t, spks, cond -> estimator_out``, time axis ``seq_len``), one graph per
#: attention variant as the official runtime keeps one file per variant; the causal vocoder split as CosyVoice2's,
#: both parts computing ``finalize=True`` on what they are given (a stream's held frames are cut by the caller).
GRAPHS3: Mapping[str, GraphSpec] = MappingProxyType({
    "flow3_estimator": GraphSpec(
        "flow3_estimator", inputs=_DIT_INPUTS, outputs=_DIT_OUTPUTS, axes=_DIT_AXES,
        doc="CosyVoice3 DiT: one Euler step's velocity, full attention over valid frames (streaming=False)",
    ),
    "flow3_estimator_streaming": GraphSpec(
        "flow3_estimator_streaming", inputs=_DIT_INPUTS, outputs=_DIT_OUTPUTS, axes=_DIT_AXES,
        doc="CosyVoice3 DiT: one Euler step's velocity, chunk-causal attention (streaming=True)",
    ),
    # CosyVoice2's vocoder tensors, the same sizes per mel frame
    "hift3_source": replace(
        GRAPHS["hift_source"], name="hift3_source", axes=_HIFT3_AXES,
        doc="causal F0 predictor (float32) + NSF sine source with the repeated phase (phase accumulation: fp32 only)",
    ),
    "hift3_decoder": replace(
        GRAPHS["hift_decoder"], name="hift3_decoder", axes=_HIFT3_AXES,
        doc="causal HiFT generator: source STFT, causal upsampling and ResBlocks, exp/sin spectrum, iSTFT, clamp",
    ),
})
#: Every graph by name, both families' (their names do not overlap): what a graph runner or a BLS call looks up.
ALL_GRAPHS: Mapping[str, GraphSpec] = MappingProxyType({**GRAPHS, **GRAPHS3})

# ------------------------------------------------------------------------------------------ served API
#: The ``cosyvoice_vc`` ensemble (the product's public API). Audio is float32 samples in [-1, 1] at any rate
#: from 4 kHz to 384 kHz with its rate beside it, or an encoded file in ``*_audio_bytes``
#: (:data:`VC_OPTIONAL_INPUTS`). The answer is float32 audio at the served rate (24 kHz unless configured).
VC_MODEL = "cosyvoice_vc"
VC_INPUTS: tuple[TensorSpec, ...] = (
    _t("source_audio", "float32", _B, "source_samples"),
    _t("source_sample_rate", "int32", _B, 1),
    _t("prompt_audio", "float32", _B, "prompt_samples"),
    _t("prompt_sample_rate", "int32", _B, 1),
)
VC_OUTPUTS: tuple[TensorSpec, ...] = (
    _t("waveform", "float32", _B, "output_samples"),
    _t("sample_rate", "int32", _B, 1),
)
#: Optional inputs of ``cosyvoice_vc``. ``seed`` of HiFT's NSF noise (default 0, as ``CosyVoice2.convert``), so the
#: same request always gives the same audio (a request parameter ``seed`` does the same). ``*_audio_bytes``: an
#: encoded file (wav/flac/ogg) instead of samples and rate, decoded by the server.
VC_OPTIONAL_INPUTS: tuple[TensorSpec, ...] = (
    _t("seed", "int64", _B, 1),
    _t("source_audio_bytes", "bytes", _B, 1),
    _t("prompt_audio_bytes", "bytes", _B, 1),
)
#: Each utterance comes either as samples with their rate or as encoded bytes: the ensemble therefore declares
#: these inputs optional too, and ``preprocess`` refuses a request that has neither (or both) for one of them.
VC_UTTERANCE_INPUTS: Mapping[str, tuple[str, str, str]] = MappingProxyType({
    "source": ("source_audio", "source_sample_rate", "source_audio_bytes"),
    "prompt": ("prompt_audio", "prompt_sample_rate", "prompt_audio_bytes"),
})

#: The stand-alone speech services (ensembles of the ``cosyvoice_vc`` stages, one utterance per request).
#: ``speech_tokens``: audio -> 25 Hz CosyVoice speech tokens (``preprocess`` -> ``speech_tokenizer``); the audio is
#: sent as ``cosyvoice_vc``'s source (``source_audio`` + ``source_sample_rate``, or ``source_audio_bytes``), at most
#: 30 s (the tokenizer's limit). ``speaker_embedding``: audio -> the 192-dim CAM++ embedding (``preprocess`` ->
#: ``speaker_encoder``); the audio is sent as ``cosyvoice_vc``'s prompt (``prompt_audio`` ... ``prompt_audio_bytes``).
#: All inputs are optional in the configs for the same reason as :data:`VC_UTTERANCE_INPUTS`.
SPEECH_TOKENS_MODEL = "speech_tokens"
SPEECH_TOKENS_INPUTS: tuple[TensorSpec, ...] = (VC_INPUTS[0], VC_INPUTS[1], VC_OPTIONAL_INPUTS[1])
SPEECH_TOKENS_OUTPUTS: tuple[TensorSpec, ...] = (_t("speech_tokens", "int32", _B, "tokens"),)
SPEAKER_EMBEDDING_MODEL = "speaker_embedding"
SPEAKER_EMBEDDING_INPUTS: tuple[TensorSpec, ...] = (VC_INPUTS[2], VC_INPUTS[3], VC_OPTIONAL_INPUTS[2])
SPEAKER_EMBEDDING_OUTPUTS: tuple[TensorSpec, ...] = (_t("speaker_embedding", "float32", _B, 192),)


#: The text-to-speech models (``ensemble/cosyvoice_tts``: whole answers, batched, HTTP and gRPC;
#: ``ensemble/cosyvoice_tts_stream``: decoupled, one response per audio chunk over a gRPC stream). One request is
#: one text (UTF-8) spoken in the voice of a prompt: ``prompt_audio`` + ``prompt_sample_rate`` or
#: ``prompt_audio_bytes`` (an encoded file), or a ``speaker_id`` registered with the ``speakers`` model.
#: ``mode``: ``zero_shot`` (needs ``prompt_text``), ``cross_lingual`` or ``instruct`` (needs ``instruct_text``);
#: absent: instruct when an instruction is given, else zero-shot when a transcript is known, else cross-lingual.
#: ``seed`` seeds the LM's sampling and HiFT's noise (default 0), as ``CosyVoice2.tts(seed=...)``.
TTS_MODEL = "cosyvoice_tts"
TTS_STREAM_MODEL = "cosyvoice_tts_stream"
TTS_INPUTS: tuple[TensorSpec, ...] = (_t("text", "bytes", _B, 1),)
TTS_OPTIONAL_INPUTS: tuple[TensorSpec, ...] = (
    _t("prompt_text", "bytes", _B, 1),
    _t("instruct_text", "bytes", _B, 1),
    _t("speaker_id", "bytes", _B, 1),
    _t("mode", "bytes", _B, 1),
    _t("prompt_audio", "float32", _B, "prompt_samples"),
    _t("prompt_sample_rate", "int32", _B, 1),
    _t("prompt_audio_bytes", "bytes", _B, 1),
    _t("seed", "int64", _B, 1),
)
#: ``cosyvoice_tts`` and ``cosyvoice_tts_stream`` (refused there unless ``stream`` is false), not the live model:
#: ``speed``, the final mel's stretch of a whole answer (models/speed.py).
TTS_WHOLE_INPUTS: tuple[TensorSpec, ...] = (_t("speed", "float32", _B, 1),)
TTS_OUTPUTS: tuple[TensorSpec, ...] = VC_OUTPUTS
#: Each streamed response: one chunk (``chunk_index`` 0, 1, ...); the stream ends with an empty final response.
TTS_STREAM_OUTPUTS: tuple[TensorSpec, ...] = (*VC_OUTPUTS, _t("chunk_index", "int32", _B, 1))
#: ``cosyvoice_tts_stream`` only: ``stream`` false answers one response per text segment (non-streaming
#: token-to-wav, what ``cosyvoice_tts`` asks of it) instead of the chunk schedule.
TTS_STREAM_EXTRA_INPUTS: tuple[TensorSpec, ...] = (_t("stream", "bool", _B, 1),)
#: What the ``speakers`` model answers to ``action`` = ``get`` (a registered :class:`~.speakers.SpeakerPrompt`).
SPEAKER_PROMPT_OUTPUTS: tuple[TensorSpec, ...] = (
    _t("prompt_tokens", "int32", _B, "prompt_tokens"),
    _t("prompt_mel", "float32", _B, "prompt_mel_frames", 80),
    _t("embedding", "float32", _B, 192),
    _t("prompt_text_tokens", "int32", _B, "prompt_text_tokens"),
    _t("prompt_text", "bytes", _B, 1),
)


#: The GPU flavors' LM (``lm_backend=tensorrtllm``): the inputs / outputs of the TensorRT-LLM backend's
#: ``tensorrt_llm`` model that a TTS orchestrator uses (a subset of that backend's interface; the first two are
#: required). ``input_ids``: the prompt in the converted engine's extended vocabulary (text ids, then sos, task
#: id and the speech-token ids shifted past the text vocabulary); ``output_ids``: speech tokens, shifted back.
TRTLLM_INPUTS: tuple[TensorSpec, ...] = (
    _t("input_ids", "int32", _B, "tokens"),
    _t("input_lengths", "int32", _B, 1),
    _t("request_output_len", "int32", _B, 1),
    _t("end_id", "int32", _B, 1),
    _t("pad_id", "int32", _B, 1),
    _t("streaming", "bool", _B, 1),
    _t("runtime_top_k", "int32", _B, 1),
    _t("runtime_top_p", "float32", _B, 1),
    _t("temperature", "float32", _B, 1),
    _t("random_seed", "uint64", _B, 1),
    _t("min_length", "int32", _B, 1),
    _t("stop", "bool", _B, 1),
    # added to the logits before sampling: the llm_decoder bias the engine's lm_head lacks, -inf on non-speech ids
    # (export/convert_llm.py writes it; the rendered config fixes its length to the converted vocabulary's)
    _t("embedding_bias", "float32", _B, "vocab"),
    _t("stop_words_list", "int32", _B, 2, "stop_words"),  # the two official stop ids besides end_id
)
TRTLLM_OUTPUTS: tuple[TensorSpec, ...] = (
    _t("output_ids", "int32", _B, "beams", "tokens"),
    _t("sequence_length", "int32", _B, "beams"),
)


# ------------------------------------------------------------------------------------ served stages
@dataclass(frozen=True)
class StageSpec:
    """A Python-backend model of the served pipeline: its tensors (first dim: the batch axis) and which inputs
    may be left out. Lengths are per request (ragged); ``max_batch_size`` bounds the requests per execution."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    optional: frozenset[str] = frozenset()
    max_batch_size: int = 16
    doc: str = ""

    def triton_dims(self, tensor: TensorSpec) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in tensor.shape[1:]]


def flow_token_room(prompt_tokens: int) -> int:
    """How many speech tokens the flow takes beside a prompt of ``prompt_tokens``: its graph's ``tokens`` axis
    less the prompt's. The served LM and the library's live TTS both stop there (``max_tokens``)."""
    return GRAPHS["flow_encoder"].axes["tokens"].max - int(prompt_tokens)


_FLOW_BATCH = min(GRAPHS["flow_encoder"].max_batch_size, GRAPHS["flow_estimator"].max_batch_size // 2)
_HIFT_BATCH = min(GRAPHS["hift_source"].max_batch_size, GRAPHS["hift_decoder"].max_batch_size)
_FRONT_BATCH = min(GRAPHS["speech_tokenizer"].max_batch_size, GRAPHS["speaker_encoder"].max_batch_size)

#: The stages between the graphs. Tensor names are the graphs' names where a tensor feeds a graph as it is
#: (``whisper_mel``, ``fbank``, ``speech_tokens``, ``speaker_embedding``, ``mel``, ``waveform``); the
#: ensemble prefixes ``source_`` / ``prompt_`` where one graph is used for both utterances.
STAGES: Mapping[str, StageSpec] = MappingProxyType({
    "preprocess": StageSpec(
        "preprocess",
        inputs=(*VC_INPUTS, *VC_OPTIONAL_INPUTS[1:]),
        outputs=(
            _t("source_whisper_mel", "float32", _B, 128, "whisper_frames"),
            _t("source_whisper_mel_len", "int32", _B, 1),
            _t("prompt_whisper_mel", "float32", _B, 128, "whisper_frames"),
            _t("prompt_whisper_mel_len", "int32", _B, 1),
            _t("prompt_fbank", "float32", _B, "fbank_frames", 80),
            _t("prompt_mel", "float32", _B, "prompt_mel_frames", 80),
        ),
        optional=frozenset(n for names in VC_UTTERANCE_INPUTS.values() for n in names),
        max_batch_size=_FRONT_BATCH,
        doc="decode, validate, resample; Whisper log-mel of source and prompt, Kaldi fbank and 24 kHz mel of prompt",
    ),
    "flow": StageSpec(
        "flow",
        inputs=(
            _t("source_speech_tokens", "int32", _B, "source_tokens"),
            _t("prompt_speech_tokens", "int32", _B, "prompt_tokens"),
            _t("prompt_mel", "float32", _B, "prompt_mel_frames", 80),
            _t("speaker_embedding", "float32", _B, 192),
        ),
        outputs=(_t("mel", "float32", _B, 80, _MEL),),
        max_batch_size=_FLOW_BATCH,
        doc="BLS: flow_encoder once, then the Euler solver with one flow_estimator call per step for the batch",
    ),
    "hift": StageSpec(
        "hift",
        inputs=(_t("mel", "float32", _B, 80, _MEL), VC_OPTIONAL_INPUTS[0]),
        outputs=(_t("waveform", "float32", _B, (_MEL, SAMPLES_PER_MEL_FRAME)),),
        optional=frozenset({"seed"}),
        max_batch_size=_HIFT_BATCH,
        doc="BLS: seeded NSF noise, hift_source then hift_decoder, items of equal length per call",
    ),
    "postprocess": StageSpec(
        "postprocess",
        inputs=(_t("waveform", "float32", _B, "samples"),),
        outputs=VC_OUTPUTS,
        max_batch_size=16,
        doc="output sample rate, optional loudness normalisation, optional encoded bytes",
    ),
})

#: The CosyVoice3 models (render tunable ``cosyvoice3_dir``): ``cosyvoice3_tts_stream`` and ``cosyvoice3_tts`` take
#: the tensors of ``cosyvoice_tts_stream`` / ``cosyvoice_tts``, ``cosyvoice3`` those of the official ``cosyvoice2``,
#: ``cosyvoice3_vc`` those of ``cosyvoice_vc`` less ``seed`` (CosyVoice3's vocoder noise is a fixed buffer);
#: ``cosyvoice3_speakers`` those of ``speakers`` (CosyVoice3's prompts, their own store); ``cosyvoice3_tts_live``
#: those of ``cosyvoice_tts_live``, ``cosyvoice3_vc_live`` those of ``cosyvoice_vc_live``.
CV3_TTS_STREAM_MODEL = "cosyvoice3_tts_stream"
CV3_TTS_LIVE_MODEL = "cosyvoice3_tts_live"
CV3_VC_LIVE_MODEL = "cosyvoice3_vc_live"
CV3_SPEAKERS_MODEL = "cosyvoice3_speakers"
CV3_TTS_MODEL = "cosyvoice3_tts"
CV3_VC_MODEL = "cosyvoice3_vc"
CV3_OFFICIAL_MODEL = "cosyvoice3"
#: ``cosyvoice3_tts_stream``'s optional choice of streaming hops: ``official`` (the official ``CosyVoice3`` class's,
#: the default) or ``runtime`` (the official CosyVoice3 Triton runtime's: cosyvoice_triton.streaming.RuntimeSchedule)
CV3_TTS_STREAM_EXTRA_INPUTS: tuple[TensorSpec, ...] = (_t("stream_schedule", "bytes", _B, 1),)
CV3_VC_INPUTS: tuple[TensorSpec, ...] = (*VC_INPUTS, *(t for t in VC_OPTIONAL_INPUTS if t.name != "seed"))
CV3_VC_OUTPUTS: tuple[TensorSpec, ...] = VC_OUTPUTS
