"""The served-model table: every served model besides the six graphs (:data:`SERVED_MODELS`, one
:class:`ServedModel` row each), the :class:`RenderContext` its rows read, the values each row renders, and the
model groups of the task tunables (TTS copies, leaf models, cached graphs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...shapes import (
    CV3_OFFICIAL_MODEL,
    CV3_SPEAKERS_MODEL,
    CV3_TTS_LIVE_MODEL,
    CV3_TTS_MODEL,
    CV3_TTS_STREAM_EXTRA_INPUTS,
    CV3_TTS_STREAM_MODEL,
    CV3_VC_INPUTS,
    CV3_VC_LIVE_MODEL,
    CV3_VC_MODEL,
    CV3_VC_OUTPUTS,
    GRAPHS,
    SPEAKER_EMBEDDING_INPUTS,
    SPEAKER_EMBEDDING_MODEL,
    SPEAKER_EMBEDDING_OUTPUTS,
    SPEECH_TOKENS_INPUTS,
    SPEECH_TOKENS_MODEL,
    SPEECH_TOKENS_OUTPUTS,
    STAGES,
    TRTLLM_INPUTS,
    TRTLLM_OUTPUTS,
    TTS_INPUTS,
    TTS_MODEL,
    TTS_OPTIONAL_INPUTS,
    TTS_OUTPUTS,
    TTS_STREAM_EXTRA_INPUTS,
    TTS_STREAM_MODEL,
    TTS_STREAM_OUTPUTS,
    TTS_WHOLE_INPUTS,
    VC_INPUTS,
    VC_MODEL,
    VC_OPTIONAL_INPUTS,
    VC_OUTPUTS,
    TensorSpec,
)
from ..samples import stage_warmup_samples
from ..stages.cosyvoice3_graphs import ESTIMATOR_GRAPHS, VOCODER_GRAPH
from ..stages.live_tts import LIVE_TTS_INPUTS, LIVE_TTS_MODEL, LIVE_TTS_OUTPUTS
from ..stages.live_vc import LIVE_VC_INPUTS, LIVE_VC_MODEL, LIVE_VC_OUTPUTS, LiveSettings
from ..stages.official_api import (
    OFFICIAL_INPUTS,
    OFFICIAL_MODEL,
    OFFICIAL_OPTIONAL,
    OFFICIAL_OUTPUTS,
    OUTPUT_SAMPLE_RATE,
)
from ..stages.speakers import SPEAKER_INPUTS, SPEAKER_OUTPUTS
from ..stages.vc_stream import VC_STREAM_INPUTS, VC_STREAM_MODEL, VC_STREAM_OUTPUTS
from .templates import (
    RenderError,
    _io_block,
)

#: The TTS entry models: priority level 1 by default when ``priority_levels`` is on and ``high_task`` is tts (the
#: rest: the lowest level).
HIGH_PRIORITY_MODELS = (TTS_STREAM_MODEL, TTS_MODEL)
#: ``task_isolation``: the stages TTS shares with VC, copied for TTS under ``<name>`` + :data:`TASK_SUFFIX`.
TASK_SUFFIX = "_tts"
ISOLATED_STAGES = ("flow", "hift")
TASK_COPIES = tuple(f"{m}{TASK_SUFFIX}" for m in (*GRAPHS, *ISOLATED_STAGES))
#: CosyVoice3's served graphs (tunable ``cosyvoice3_onnx_dir``): the DiT estimator's two attention variants and the
#: vocoder's generator.
CV3_GRAPH_MODELS = (*ESTIMATOR_GRAPHS, VOCODER_GRAPH)
#: Models that call no other model: the only ones the rate limiter may hold (no hold-and-wait).
LEAF_MODELS = (*GRAPHS, *(f"{g}{TASK_SUFFIX}" for g in GRAPHS), *CV3_GRAPH_MODELS, "preprocess", "postprocess")


#: The Python models that read the ``nice`` parameter (and the graphs of flavor local).
NICE_MODELS = ("preprocess", "flow", "hift", "postprocess", TTS_STREAM_MODEL, TTS_MODEL)


#: The graphs that get ``response_cache { enable: true }`` when ``response_cache_mb`` > 0, and (flavor local) the
#: parameter ``graph_cache_mb`` (their own cache of successful answers, tunable ``graph_cache_mb``): the prompt side of
#: ``cosyvoice_vc`` (a repeated prompt's features are byte-identical, so its requests hit). The tokenizer's source
#: requests go through the cache too (misses; small entries: the tokens).
RESPONSE_CACHE_GRAPHS = ("speech_tokenizer", "speaker_encoder")


@dataclass(frozen=True)
class RenderContext:
    """What a :class:`ServedModel`'s callables may read: the flavor, the tunables, the model folder, and whether
    the TTS models are rendered (``has_tts``)."""

    flavor: str
    tunables: Any  # the render's :class:`~.tunables.Tunables` (which validates model names against this table)
    model_dir: Path
    has_tts: bool
    engine_dir: Path = Path("build/engines")
    cosyvoice3_dir: Path | None = None  # tunable cosyvoice3_dir, resolved and checked
    cosyvoice3_graphs: bool = False  # the CosyVoice3 estimator graphs are served (tunable cosyvoice3_onnx_dir)


@dataclass(frozen=True)
class ServedModel:
    """One served model besides the six graphs: a row of :data:`SERVED_MODELS`.

    ``folder``: where its sources live, relative to the source root (``model_repository/<name>`` for a stage,
    ``ensemble/<name>`` for a pipeline): ``model.py`` of a Python model (copied to ``<name>/1/model.py``), or
    ``config.pbtxt.in`` of an ensemble or of a model of another backend (``kind="ensemble"`` / ``"backend"``:
    rendered with ``name``, ``inputs``, ``outputs`` and what ``values(ctx)`` adds; ``doc`` starts with the
    backend's name). A Python model's config comes from ``template`` (the shared
    ``model_repository/stage/config.pbtxt.in``) with the tensors, ``max_batch_size``, ragged batching,
    ``decoupled`` (``model_transaction_policy``), the instance count (tunable ``instances``, else
    ``instances``), ``parameters(ctx)`` (keys declared in ``MODEL_PARAMS[params_key or name]``) and the warm-up
    of ``warmup(ctx)`` (sample tensors of batch 1, or None). ``enabled(ctx)``: render it at all.
    """

    name: str
    folder: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    optional: frozenset[str] = frozenset()
    kind: str = "python"  # python | ensemble | backend (another backend's config from the folder's template)
    template: str = "model_repository/stage/config.pbtxt.in"
    max_batch_size: int = 1
    decoupled: bool | Callable[[RenderContext], bool] = False  # or a function of the render context
    instances: int = 1
    parameters: Callable[[RenderContext], Mapping[str, Any]] | None = None
    params_key: str = ""
    warmup: Callable[[RenderContext], Mapping[str, np.ndarray] | None] | None = None
    values: Callable[[RenderContext], Mapping[str, Any]] | None = None
    when: Callable[[RenderContext], bool] | None = None
    doc: str = ""

    def enabled(self, ctx: RenderContext) -> bool:
        return self.when is None or bool(self.when(ctx))

    def is_decoupled(self, ctx: RenderContext) -> bool:
        return bool(self.decoupled(ctx)) if callable(self.decoupled) else self.decoupled


def _stage(name: str, **kw: Any) -> ServedModel:
    spec = STAGES[name]
    return ServedModel(name, f"model_repository/{name}", spec.inputs, spec.outputs, spec.optional,
                       max_batch_size=spec.max_batch_size, doc=spec.doc, **kw)


def _stage_warmup(name: str) -> Callable[[RenderContext], Mapping[str, np.ndarray] | None]:
    def samples(ctx: RenderContext) -> Mapping[str, np.ndarray] | None:
        tun = ctx.tunables
        return stage_warmup_samples(name, min(max(1.0, tun.min_seconds), tun.max_seconds))
    return samples


def _vc_values(ctx: RenderContext) -> dict[str, str]:
    return {"postprocess_extra_outputs": ('\n      output_map { key: "audio_bytes" value: "audio_bytes" }'
                                          if ctx.tunables.output_format else "")}


def _output_params(ctx: RenderContext) -> dict[str, Any]:
    """The output options (``postprocess``'s) for the pipelines that answer audio without that stage."""
    tun = ctx.tunables
    return {"output_sample_rate": tun.output_sample_rate, "loudness_lufs": tun.loudness_lufs,
            "peak_dbfs": tun.peak_dbfs}


def _tts_params(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    return {**_output_params(ctx), "model_dir": str(ctx.model_dir), "max_active_requests": tun.max_active_requests,
            "max_waiting_requests": tun.max_waiting_requests, "wait_timeout_s": tun.tts_wait_timeout_s,
            "max_text_chars": tun.max_text_chars, "max_text_digit_run": tun.max_text_digit_run,
            "max_text_digits": tun.max_text_digits, "n_timesteps": tun.n_timesteps,
            "bls_timeout_us": tun.bls_timeout_us, "torch_threads": tun.torch_threads,
            "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds, **_prompt_cache_params(ctx),
            "stage_suffix": TASK_SUFFIX if tun.task_isolation else "", "lm_precision": tun.lm_precision,
            **tun.stream_params(), **_stream_state_params(ctx)}


def _tts_front_params(ctx: RenderContext) -> dict[str, Any]:
    return {**_output_params(ctx), "stream_model": TTS_STREAM_MODEL, "bls_timeout_us": ctx.tunables.bls_timeout_us,
            "model_sample_rate": _model_sample_rate(ctx.model_dir)}


def _trtllm_values(ctx: RenderContext) -> dict[str, Any]:
    from dataclasses import replace

    from ...errors import CosyVoiceError
    from ...export.trtllm import served_vocabulary

    llm_dir = ctx.engine_dir / "llm"  # what export/convert_llm.py --build-engine writes (make engines-llm)
    try:  # the converted vocabulary, checked against the engine's config where one is built
        vocab_size, note = served_vocabulary(llm_dir, ctx.tunables.max_active_requests)
    except CosyVoiceError as exc:
        raise RenderError(f"lm_backend=tensorrtllm: {exc}") from exc
    inputs = [replace(t, shape=(t.shape[0], vocab_size)) if t.name == "embedding_bias" and vocab_size else t
              for t in TRTLLM_INPUTS]
    return {"max_batch_size": ctx.tunables.max_active_requests, "engine_dir": str(llm_dir), "vocab_note": note,
            "inputs": _io_block("input", inputs, optional=[t.name for t in TRTLLM_INPUTS[2:]])}


def _live_sessions(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    return {"max_sessions": tun.live_max_sessions, "max_queued": tun.live_max_queued,
            "idle_timeout_s": tun.live_idle_timeout_s}


def _live_vc_session_params(ctx: RenderContext) -> dict[str, Any]:
    """The sessions, chunks and windows of a live VC model (either family's), checked."""
    tun = ctx.tunables
    try:
        settings = LiveSettings(chunk_tokens=tun.live_chunk_tokens,
                                tokenizer_context_tokens=tun.live_tokenizer_context_tokens,
                                tokenizer_lookahead_tokens=tun.live_tokenizer_lookahead_tokens,
                                flow_context_tokens=tun.live_flow_context_tokens,
                                max_piece_seconds=tun.live_max_piece_seconds)
    except ValueError as exc:
        raise RenderError(f"tunables live_*: {exc}") from exc
    if tun.live_max_sessions < 1 or tun.live_max_queued < 1 or not tun.live_idle_timeout_s > 0:
        raise RenderError("tunables live_max_sessions and live_max_queued must be >= 1, live_idle_timeout_s > 0")
    return {**_live_sessions(ctx), **dataclasses.asdict(settings)}


def _live_vc_params(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    return {"model_dir": str(ctx.model_dir), "n_timesteps": tun.n_timesteps, "default_seed": tun.default_seed,
            "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds, **_live_vc_session_params(ctx),
            "bls_timeout_us": tun.bls_timeout_us, **_output_params(ctx), **_prompt_cache_params(ctx),
            **_stream_state_params(ctx), "torch_threads": tun.torch_threads}


def _live_tts_session_params(ctx: RenderContext) -> dict[str, Any]:
    """The session parameters of a live TTS model (either family's), checked."""
    tun = ctx.tunables
    if tun.live_tts_max_sessions < 1 or tun.live_tts_max_queued < 1 or not tun.live_text_timeout_s > 0 \
            or not tun.live_tts_max_token_text_ratio > 0:
        raise RenderError("tunables live_tts_max_sessions and live_tts_max_queued must be >= 1, live_text_timeout_s "
                          "and live_tts_max_token_text_ratio > 0")
    return {"max_sessions": tun.live_tts_max_sessions, "max_queued": tun.live_tts_max_queued,
            "text_timeout_s": tun.live_text_timeout_s, "max_token_text_ratio": tun.live_tts_max_token_text_ratio}


def _live_tts_params(ctx: RenderContext) -> dict[str, Any]:
    return {**_tts_params(ctx), **_live_tts_session_params(ctx)}


def _live_values(ctx: RenderContext, sessions: int | None = None, idle_s: float | None = None) -> dict[str, str]:
    """The sequence batcher of a live model: Triton routes each stream's pieces in order; it holds up to twice the
    model's sessions (a refused stream keeps its slot until its END or the idle timeout) and forgets a sequence a
    little after the model's idle timeout (the model's own message about it comes first). ``sessions`` /
    ``idle_s``: the model's (default: ``live_max_sessions`` / ``live_idle_timeout_s``)."""
    tun = ctx.tunables
    sessions = tun.live_max_sessions if sessions is None else sessions
    idle_us = int(((tun.live_idle_timeout_s if idle_s is None else idle_s) + 5.0) * 1e6)
    return {"dynamic_batching": "# no dynamic_batching: the sequence batcher routes each stream's pieces",
            "sequence_batching": f"sequence_batching {{\n  max_sequence_idle_microseconds: {idle_us}\n  oldest {{\n"
                                 f"    max_candidate_sequences: {2 * sessions}\n"
                                 "    max_queue_delay_microseconds: 0\n  }\n}"}


def _tts(ctx: RenderContext) -> bool:
    return ctx.has_tts


def _official(ctx: RenderContext) -> bool:
    """``cosyvoice2``: with the TTS models, where they answer the official 24 kHz (a deployment that resamples its
    output elsewhere does not get it: the official clients write the samples at 24 kHz whatever they are)."""
    rate = ctx.tunables.output_sample_rate or _model_sample_rate(ctx.model_dir)
    return ctx.has_tts and rate == OUTPUT_SAMPLE_RATE


def _cv3(ctx: RenderContext) -> bool:
    return ctx.cosyvoice3_dir is not None


def _cv3_official(ctx: RenderContext) -> bool:
    """``cosyvoice3``: with the CosyVoice3 models, where they answer the official 24 kHz."""
    return _cv3(ctx) and (ctx.tunables.output_sample_rate or OUTPUT_SAMPLE_RATE) == OUTPUT_SAMPLE_RATE


def _cv3_params(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    return {"model_dir": str(ctx.cosyvoice3_dir), "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds,
            "wait_timeout_s": tun.tts_wait_timeout_s, "output_sample_rate": tun.output_sample_rate,
            "torch_threads": tun.torch_threads, "flow_precision": tun.cosyvoice3_flow_precision,
            "estimator_models": ",".join(ESTIMATOR_GRAPHS) if ctx.cosyvoice3_graphs else "",
            "vocoder_model": VOCODER_GRAPH if ctx.cosyvoice3_graphs else "",
            "bls_timeout_us": tun.bls_timeout_us, "concurrency": tun.cosyvoice3_concurrency}


def _cv3_tts_params(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    return {**_cv3_params(ctx), "lm_precision": tun.lm_precision, "speakers_model": CV3_SPEAKERS_MODEL,
            "bls_timeout_us": tun.bls_timeout_us, "max_text_chars": tun.max_text_chars,
            "max_text_digit_run": tun.max_text_digit_run, "max_text_digits": tun.max_text_digits,
            **tun.cv3_stream_state_params()}


def _cv3_live_tts_params(ctx: RenderContext) -> dict[str, Any]:
    return {**_cv3_tts_params(ctx), **_live_tts_session_params(ctx)}


def _cv3_live_vc_params(ctx: RenderContext) -> dict[str, Any]:
    return {**_cv3_params(ctx), "speakers_model": CV3_SPEAKERS_MODEL, "bls_timeout_us": ctx.tunables.bls_timeout_us,
            **_live_vc_session_params(ctx)}


def _speakers_params(ctx: RenderContext, model_dir: Path, speaker_dir: str) -> dict[str, Any]:
    """What a speakers model of either family reads, but its family and BLS timeout."""
    tun = ctx.tunables
    return {"model_dir": str(model_dir), "speaker_dir": speaker_dir, "capacity": tun.speaker_capacity,
            "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds, **_prompt_cache_params(ctx)}


def _stream_state_params(ctx: RenderContext) -> dict[str, Any]:
    """The streams' flow state (serving/stages/stream_state.py): its flow runs where the graphs run (cuda in the onnx
    and trt flavors unless their instances are put on the CPU), else on the ``device`` tunable."""
    tun = ctx.tunables
    gpu = ctx.flavor in ("onnx", "trt") and (tun.instance_kind or "KIND_GPU") == "KIND_GPU"
    return {**tun.stream_state_params(), "device": "cuda" if gpu else tun.device}


def _prompt_cache_params(ctx) -> dict[str, Any]:
    return {"prompt_cache_entries": ctx.tunables.prompt_cache_entries, "prompt_cache_mb": ctx.tunables.prompt_cache_mb}


#: Every served model besides the graphs, in render order. A new model is one row here + its folder (+ its
#: ``MODEL_PARAMS`` entry when it reads parameters); see model_repository/README.md.
SERVED_MODELS: tuple[ServedModel, ...] = (
    _stage("preprocess", warmup=_stage_warmup("preprocess"), parameters=lambda ctx: {
        "model_dir": str(ctx.model_dir), "min_seconds": ctx.tunables.min_seconds,
        "max_seconds": ctx.tunables.max_seconds, "vad_trim": ctx.tunables.vad_trim,
        "denoise_prompt": ctx.tunables.denoise_prompt, **_prompt_cache_params(ctx)}),
    _stage("flow", parameters=lambda ctx: {  # BLS: no warm-up (its callees may not be loaded yet)
        "model_dir": str(ctx.model_dir), "n_timesteps": ctx.tunables.n_timesteps, "encoder_model": "flow_encoder",
        "estimator_model": "flow_estimator", "bls_timeout_us": ctx.tunables.bls_timeout_us,
        "torch_threads": ctx.tunables.torch_threads}),
    _stage("hift", parameters=lambda ctx: {
        "source_model": "hift_source", "decoder_model": "hift_decoder", "default_seed": ctx.tunables.default_seed,
        "bls_timeout_us": ctx.tunables.bls_timeout_us, "torch_threads": ctx.tunables.torch_threads}),
    _stage("postprocess", warmup=_stage_warmup("postprocess"), parameters=lambda ctx: {
        "model_sample_rate": _model_sample_rate(ctx.model_dir), **_output_params(ctx),
        "output_format": ctx.tunables.output_format}),
    ServedModel(VC_MODEL, f"ensemble/{VC_MODEL}", (*VC_INPUTS, *VC_OPTIONAL_INPUTS), VC_OUTPUTS,
                frozenset(t.name for t in (*VC_INPUTS, *VC_OPTIONAL_INPUTS)), kind="ensemble", values=_vc_values,
                doc="voice conversion: preprocess -> speech_tokenizer x2, speaker_encoder -> flow -> hift -> "
                    "postprocess"),
    ServedModel(SPEECH_TOKENS_MODEL, f"ensemble/{SPEECH_TOKENS_MODEL}", SPEECH_TOKENS_INPUTS, SPEECH_TOKENS_OUTPUTS,
                frozenset(t.name for t in SPEECH_TOKENS_INPUTS), kind="ensemble",
                doc="audio (as cosyvoice_vc's source) -> 25 Hz speech tokens: preprocess (source only) -> "
                    "speech_tokenizer"),
    ServedModel(SPEAKER_EMBEDDING_MODEL, f"ensemble/{SPEAKER_EMBEDDING_MODEL}", SPEAKER_EMBEDDING_INPUTS,
                SPEAKER_EMBEDDING_OUTPUTS, frozenset(t.name for t in SPEAKER_EMBEDDING_INPUTS), kind="ensemble",
                doc="audio (as cosyvoice_vc's prompt) -> 192-dim CAM++ embedding: preprocess (prompt fbank only) -> "
                    "speaker_encoder"),
    ServedModel("speakers", "model_repository/speakers", SPEAKER_INPUTS, SPEAKER_OUTPUTS,
                frozenset(t.name for t in SPEAKER_INPUTS[1:]), parameters=lambda ctx: {
                    **_speakers_params(ctx, ctx.model_dir, ctx.tunables.speaker_dir),
                    "bls_timeout_us": ctx.tunables.bls_timeout_us},
                doc="register / get / list / delete speakers (one instance owns the store); BLS: speech_tokenizer, "
                    "speaker_encoder"),
    ServedModel(VC_STREAM_MODEL, f"ensemble/{VC_STREAM_MODEL}", VC_STREAM_INPUTS, VC_STREAM_OUTPUTS,
                frozenset(t.name for t in VC_STREAM_INPUTS), decoupled=True, parameters=lambda ctx: {
                    "model_dir": str(ctx.model_dir), "n_timesteps": ctx.tunables.n_timesteps,
                    "default_seed": ctx.tunables.default_seed, "min_seconds": ctx.tunables.min_seconds,
                    "max_seconds": ctx.tunables.max_seconds, "bls_timeout_us": ctx.tunables.bls_timeout_us,
                    "max_streams": ctx.tunables.vc_max_streams, "max_waiting": ctx.tunables.vc_max_waiting,
                    **ctx.tunables.stream_params(), **_output_params(ctx), **_prompt_cache_params(ctx),
                    **_stream_state_params(ctx), "torch_threads": ctx.tunables.torch_threads},
                doc="streaming voice conversion (decoupled BLS orchestrator): one response per chunk on the official "
                    "schedule; chunked flow_encoder / flow_estimator / hift graphs"),
    ServedModel(LIVE_VC_MODEL, f"ensemble/{LIVE_VC_MODEL}", LIVE_VC_INPUTS, LIVE_VC_OUTPUTS,
                frozenset(t.name for t in LIVE_VC_INPUTS), template=f"ensemble/{LIVE_VC_MODEL}/config.pbtxt.in",
                decoupled=True, parameters=lambda ctx: _live_vc_params(ctx), values=lambda ctx: _live_values(ctx),
                doc="live voice conversion (decoupled BLS orchestrator, sequence batcher): one request per piece of "
                    "source audio as it is recorded, converted chunks as soon as they can be computed"),
    ServedModel(TTS_STREAM_MODEL, f"ensemble/{TTS_STREAM_MODEL}",
                (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS), TTS_STREAM_OUTPUTS,
                frozenset(t.name for t in (*TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS)),
                max_batch_size=8,
                decoupled=True, parameters=_tts_params, when=_tts,
                doc="streaming TTS (BLS orchestrator, decoupled): text front end, prompt features "
                    "(speech_tokenizer, speaker_encoder or the speakers model), ONE in-flight batched LM loop per "
                    "instance, token2wav per chunk (flow_encoder / flow_estimator / hift_source / hift_decoder)"),
    ServedModel(LIVE_TTS_MODEL, f"ensemble/{LIVE_TTS_MODEL}", LIVE_TTS_INPUTS, LIVE_TTS_OUTPUTS,
                frozenset(t.name for t in LIVE_TTS_INPUTS), template=f"ensemble/{LIVE_TTS_MODEL}/config.pbtxt.in",
                decoupled=True, parameters=lambda ctx: _live_tts_params(ctx), when=_tts,
                values=lambda ctx: _live_values(ctx, ctx.tunables.live_tts_max_sessions,
                                                ctx.tunables.live_text_timeout_s),
                doc="live TTS (decoupled BLS orchestrator, sequence batcher): one request per piece of text as it is "
                    "written, audio as soon as the LM has its speech tokens (its own LM decode per session)"),
    ServedModel(TTS_MODEL, f"ensemble/{TTS_MODEL}", (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS),
                TTS_OUTPUTS, frozenset(t.name for t in (*TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS)), max_batch_size=8,
                parameters=_tts_front_params,
                when=_tts, doc=f"non-streaming TTS: each request of a batch sent on to {TTS_STREAM_MODEL} "
                               "(stream=false: one answer per text segment) by BLS, the segments concatenated"),
    ServedModel("tensorrt_llm", "model_repository/tensorrt_llm", TRTLLM_INPUTS, TRTLLM_OUTPUTS,
                frozenset(t.name for t in TRTLLM_INPUTS[2:]), kind="backend", values=_trtllm_values,
                when=lambda ctx: ctx.tunables.lm_backend == "tensorrtllm",
                doc="tensorrtllm: the LM as a TensorRT-LLM engine (in-flight batching, paged KV cache, streaming)"),
    ServedModel(CV3_TTS_STREAM_MODEL, f"ensemble/{CV3_TTS_STREAM_MODEL}",
                (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS,
                 *CV3_TTS_STREAM_EXTRA_INPUTS), TTS_STREAM_OUTPUTS,
                frozenset(t.name for t in (*TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS, *TTS_STREAM_EXTRA_INPUTS,
                                           *CV3_TTS_STREAM_EXTRA_INPUTS)),
                max_batch_size=1, decoupled=True, when=_cv3,
                parameters=_cv3_tts_params,
                doc="CosyVoice3 TTS (decoupled; the tensors of cosyvoice_tts_stream): the cosyvoice3_dir folder "
                    "in process, cosyvoice3_concurrency requests at a time per instance, chunks on the official "
                    f"CosyVoice3 schedule; a speaker_id from {CV3_SPEAKERS_MODEL} (BLS)"),
    ServedModel(CV3_TTS_LIVE_MODEL, f"ensemble/{CV3_TTS_LIVE_MODEL}", LIVE_TTS_INPUTS, LIVE_TTS_OUTPUTS,
                frozenset(t.name for t in LIVE_TTS_INPUTS), template=f"ensemble/{LIVE_TTS_MODEL}/config.pbtxt.in",
                decoupled=True, parameters=_cv3_live_tts_params, when=_cv3,
                values=lambda ctx: _live_values(ctx, ctx.tunables.live_tts_max_sessions,
                                                ctx.tunables.live_text_timeout_s),
                doc="CosyVoice3 live TTS (decoupled, sequence batcher; the tensors of cosyvoice_tts_live): the "
                    "cosyvoice3_dir folder in process, one session at a time per instance, audio as soon as the "
                    "LM has its speech tokens"),
    ServedModel(CV3_VC_LIVE_MODEL, f"ensemble/{CV3_VC_LIVE_MODEL}", LIVE_VC_INPUTS, LIVE_VC_OUTPUTS,
                frozenset(t.name for t in LIVE_VC_INPUTS), template=f"ensemble/{LIVE_VC_MODEL}/config.pbtxt.in",
                decoupled=True, parameters=_cv3_live_vc_params, when=_cv3, values=lambda ctx: _live_values(ctx),
                doc="CosyVoice3 live voice conversion (decoupled, sequence batcher; the tensors of cosyvoice_vc_live, "
                    "seed refused): the cosyvoice3_dir folder in process, a sliding flow window and a bounded "
                    "vocoder window per session, one piece at a time per instance"),
    ServedModel(CV3_SPEAKERS_MODEL, "model_repository/speakers", SPEAKER_INPUTS, SPEAKER_OUTPUTS,
                frozenset(t.name for t in SPEAKER_INPUTS[1:]), params_key="speakers", when=_cv3,
                parameters=lambda ctx: {
                    **_speakers_params(ctx, ctx.cosyvoice3_dir, str(Path(ctx.tunables.speaker_dir) / "cosyvoice3")),
                    "family": "cosyvoice3"},
                doc="register / get / list / delete CosyVoice3 speakers (one instance owns the store, in "
                    "<speaker_dir>/cosyvoice3): speech_tokenizer_v3 and CAM++ of the cosyvoice3_dir folder in "
                    "process"),
    ServedModel(CV3_TTS_MODEL, "ensemble/cosyvoice_tts", (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS),
                TTS_OUTPUTS, frozenset(t.name for t in (*TTS_OPTIONAL_INPUTS, *TTS_WHOLE_INPUTS)), max_batch_size=8,
                params_key=TTS_MODEL, when=_cv3,
                parameters=lambda ctx: {**_output_params(ctx), "stream_model": CV3_TTS_STREAM_MODEL,
                                        "bls_timeout_us": ctx.tunables.bls_timeout_us,
                                        "model_sample_rate": OUTPUT_SAMPLE_RATE},
                doc=f"non-streaming CosyVoice3 TTS: the adapter of {TTS_MODEL} sent on to {CV3_TTS_STREAM_MODEL}"),
    ServedModel(CV3_VC_MODEL, f"ensemble/{CV3_VC_MODEL}", CV3_VC_INPUTS, CV3_VC_OUTPUTS,
                frozenset(t.name for t in CV3_VC_INPUTS), max_batch_size=1, when=_cv3,
                parameters=_cv3_params, values=lambda ctx: {"max_batch_size": ctx.tunables.cosyvoice3_concurrency},
                doc="CosyVoice3 voice conversion (the tensors of cosyvoice_vc less seed): the cosyvoice3_dir "
                    "folder in process, cosyvoice3_concurrency requests at a time per instance (each in its own "
                    "thread)"),
    ServedModel(CV3_OFFICIAL_MODEL, f"ensemble/{OFFICIAL_MODEL}", OFFICIAL_INPUTS, OFFICIAL_OUTPUTS,
                OFFICIAL_OPTIONAL, max_batch_size=8, params_key=OFFICIAL_MODEL,
                decoupled=lambda ctx: ctx.tunables.cosyvoice3_decoupled, when=_cv3_official,
                parameters=lambda ctx: {"offline_model": CV3_TTS_MODEL, "stream_model": CV3_TTS_STREAM_MODEL,
                                        "keep_empty_reference_text": True,
                                        "stream_schedule": ctx.tunables.cosyvoice3_stream_schedule,
                                        "bls_timeout_us": ctx.tunables.bls_timeout_us},
                doc="the official CosyVoice runtime's CosyVoice3 interface (as cosyvoice2's): "
                    f"{CV3_TTS_STREAM_MODEL} when decoupled (tunable cosyvoice3_decoupled; chunks on the official "
                    f"runtime's hops unless cosyvoice3_stream_schedule=official), else {CV3_TTS_MODEL}"),
    ServedModel(OFFICIAL_MODEL, f"ensemble/{OFFICIAL_MODEL}", OFFICIAL_INPUTS, OFFICIAL_OUTPUTS, OFFICIAL_OPTIONAL,
                max_batch_size=8, decoupled=lambda ctx: ctx.tunables.cosyvoice2_decoupled, when=_official,
                parameters=lambda ctx: {"offline_model": TTS_MODEL, "stream_model": TTS_STREAM_MODEL,
                                        "bls_timeout_us": ctx.tunables.bls_timeout_us},
                doc="the official CosyVoice runtime's interface (reference_wav, reference_wav_len, reference_text, "
                    f"target_text -> waveform at 24 kHz; BLS orchestrator): {TTS_STREAM_MODEL} when decoupled "
                    f"(tunable cosyvoice2_decoupled), else {TTS_MODEL}"),
)
SERVED_NAMES = tuple(m.name for m in SERVED_MODELS)


def _model_sample_rate(model_dir: Path) -> int:
    from ...config import ModelConfig

    path = model_dir / "cosyvoice2.yaml"
    return ModelConfig.from_yaml(path).sample_rate if path.is_file() else 24000
