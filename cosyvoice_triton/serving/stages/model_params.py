"""The config ``parameters`` each served model reads: one declaration for the renderer and the adapters.

The renderer (:mod:`cosyvoice_triton.serving.repository`) writes exactly these keys into each ``config.pbtxt``, and
each ``model.py`` reads them with :func:`~.params.read_parameters` in ``initialize()``, which refuses unknown
keys and values of the wrong type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from .params import Param

__all__ = ["MODEL_PARAMS"]

_THREADS = Param("intra_op_threads", int, 1, "onnxruntime intra-op threads of this instance (0: all cores)")
_TORCH_THREADS = Param("torch_threads", int, 1, "torch intra-op threads of this instance")
_BLS_TIMEOUT = Param("bls_timeout_us", int, 0, "timeout of each BLS call in microseconds (0: none)")
_NICE = Param("nice", int, 0, "CPU niceness of this instance's process, 0-19 (tunable task_nice on the models of the "
              "low-priority task: the kernel then prefers the other task's processes; 0: unchanged)")
_PROMPT_CACHE = (
    Param("prompt_cache_entries", int, 256, "prompts kept by content hash (cosyvoice_triton.prompt_cache; 0: off)"),
    Param("prompt_cache_mb", float, 64.0, "most MiB of arrays the prompt cache keeps (0: off)"),
)
#: The session limits of the live models (``cosyvoice_vc_live``, ``cosyvoice_tts_live``: serving/stages/live.py).
_LIVE_SESSIONS = (
    Param("max_sessions", int, 4, "live sessions held at once; a stream beyond is refused at its start (UNAVAILABLE)"),
    Param("max_queued", int, 8, "pieces waiting per session; a faster sender's next piece is refused (UNAVAILABLE)"),
    Param("idle_timeout_s", float, 30.0, "a session without a new piece for this long is freed"),
)
#: Live conversion's chunks and windows (either family: serving/stages/live_vc.py LiveSettings).
_LIVE_VC = (
    Param("chunk_tokens", int, 25, "speech tokens (40 ms each) per converted chunk; a multiple of 25 keeps the "
          "flow's chunk-causal blocks aligned"),
    Param("tokenizer_context_tokens", int, 75, "tokens of audio before the new ones in each tokenizer window"),
    Param("tokenizer_lookahead_tokens", int, 5, "tokens of audio after the new ones in each tokenizer window "
          "(adds to the latency)"),
    Param("flow_context_tokens", int, 100, "source tokens before a chunk that the flow still sees (bounds the "
          "state and the cost per chunk of a long stream)"),
    Param("max_piece_seconds", float, 5.0, "longest accepted piece of source audio"),
)
#: The streaming hops (cosyvoice_triton.streaming.StreamSchedule; the defaults are the official schedule).
_STREAM_SCHEDULE = (
    Param("stream_first_hop", int, 25, "speech tokens of the first streamed chunk, before the pad that ends it on a "
          "25-token boundary of the flow's chunk-causal attention"),
    Param("stream_hop_growth", int, 2, "factor of each next hop (every later hop must be a multiple of 25)"),
    Param("stream_max_hop", int, 100, "largest hop in speech tokens (a multiple of 25)"),
)
#: The streams' flow state (serving/stages/stream_state.py).
_STREAM_STATE = (
    Param("stream_state", bool, True, "non-final streamed chunks compute only their new frames from the stream's "
          "cached flow state (the checkpoint's PyTorch flow in this instance; the final chunk runs the graphs); "
          "false: every chunk runs the flow graphs over every frame"),
    Param("stream_state_mb", float, 2048.0, "most MiB of flow state one stream holds; beyond, it recomputes from "
          "there"),
    Param("stream_state_total_mb", float, 4096.0, "most MiB of flow state all streams of this instance hold; a "
          "stream that would pass it recomputes from there"),
    Param("speaker_state_mb", float, 1024.0, "MiB of registered speakers' settled prompt frames kept by content "
          "(their streams start after them; 0: off)"),
    Param("device", str, "cpu", "where the stream state's flow runs: cpu or cuda[:N]"),
)
#: The output options of ``postprocess``, also read by the pipelines that answer audio without it (the streaming
#: models apply what a stream can: the rate; ``cosyvoice_tts`` the loudness of the whole answer).
_OUTPUT = (
    Param("output_sample_rate", int, 0, "rate of the served waveform (0: the model's)"),
    Param("loudness_lufs", float, 0.0, "integrated loudness target in LUFS (0: off; whole answers only)"),
    Param("peak_dbfs", float, -1.0, "peak ceiling of the loudness gain"),
)

#: What every CosyVoice3 model reads (serving/stages/cosyvoice3.py: ``concurrency`` requests at a time per instance).
_CV3_COMMON = (
    Param("min_seconds", float, 0.1, "shortest accepted prompt / source audio"),
    Param("max_seconds", float, 30.0, "longest accepted prompt / source audio"),
    Param("wait_timeout_s", float, 60.0, "a request that waits longer for the instance is refused (UNAVAILABLE)"),
    Param("output_sample_rate", int, 0, "rate of the served waveform (0: the model's)"),
    Param("flow_precision", str, "fp32", "the flow's DiT blocks: fp32, or int8 (PyTorch's CPU INT8 Linear)",
          ("fp32", "int8")),
    Param("estimator_models", str, "", "the served DiT estimator graphs 'FULL,STREAMING' the flow's Euler steps call "
          "by BLS (serving/stages/cosyvoice3_graphs.py; empty: the DiT in process)"),
    Param("vocoder_model", str, "", "the served vocoder generator graph (hift3_decoder) the vocoder calls by BLS "
          "(serving/stages/cosyvoice3_graphs.py; empty: the generator in process)"),
    Param("concurrency", int, 1, "requests computing at once in one instance (one copy of the weights; more wait "
          "up to wait_timeout_s)"),
    _TORCH_THREADS,
)

#: What builds a served TTSService (``cosyvoice_tts_stream``, ``cosyvoice_tts_live``: serving/stages/tts.py
#: build_service).
_TTS_SERVICE = (
    Param("model_dir", str, None, "the CosyVoice2 folder (llm.pt, CosyVoice-BlankEN/, cosyvoice2.yaml)"),
    Param("max_active_requests", int, 8, "rows of the in-flight LM batch (one decode loop per instance)"),
    Param("max_waiting_requests", int, 16, "requests waiting for an LM row; more are refused (UNAVAILABLE)"),
    Param("wait_timeout_s", float, 60.0, "a request that waits longer for an LM row is refused"),
    Param("max_text_chars", int, 2000, "longest accepted text"),
    Param("max_text_digit_run", int, 32, "longest run of digits in a text (number normalisation's cost grows with it)"),
    Param("max_text_digits", int, 256, "most digits in one text"),
    Param("n_timesteps", int, 0, "flow Euler steps of streamed chunks (0: the model's)"),
    Param("lm_precision", str, "fp32", "the LM's Linear layers: fp32; int8 (PyTorch's dynamic INT8 on the CPU, "
          "cosyvoice_triton.models.lm_quant: about 3-4x the decode rate, outside the fp32 quality bar); or fp32-ort "
          "(fp32 on onnxruntime's MatMul, cosyvoice_triton.models.lm_ort: fp32's results, torch_threads per layer)",
          ("fp32", "int8", "fp32-ort")),
    *_STREAM_SCHEDULE,
    Param("min_seconds", float, 0.1, "shortest accepted prompt audio"),
    Param("max_seconds", float, 30.0, "longest accepted prompt audio"),
    *_PROMPT_CACHE,
    Param("lm_prefix_cache_mb", float, 64.0, "MiB of LM prefixes (KV cache of sos + a registered speaker's "
          "transcript) kept by content, so its requests prefill only what follows (0: off)"),
    Param("speakers_model", str, "speakers", "the Triton model of registered speakers (speaker_id)"),
    Param("stage_suffix", str, "", "appended to the names of the graphs and of flow / hift it calls ('_tts': "
          "the TTS task's own copies, tunable task_isolation)"),
    *_OUTPUT,
    *_STREAM_STATE,
    _BLS_TIMEOUT,
    _TORCH_THREADS,
    _NICE,
)
#: The streams' flow state as CosyVoice3's streaming models read it (the same parameters; their flow is the instance's).
_CV3_STREAM_STATE_DOCS = {
    "stream_state": "non-final streamed chunks compute only the frames the stream does not hold yet, from its cached "
                    "DiT keys/values (models/cosyvoice3/incremental.py; the final chunk recomputes); false: every "
                    "chunk runs the flow over every frame, as the official code",
    "stream_state_mb": "most MiB of flow state one stream holds (about 3.6 MB per settled mel frame at "
                       "Fun-CosyVoice3-0.5B dims); beyond, it recomputes from there",
    "stream_state_total_mb": "most MiB of flow state all streams of this instance hold; a stream that would pass it "
                             "recomputes from there",
}
#: What builds a served CosyVoice3 ``Cv3Service`` for text to speech (serving/stages/cosyvoice3.py).
_CV3_TTS = (
        Param("model_dir", str, None, "the CosyVoice3 folder (cosyvoice3.yaml, llm.pt, flow.pt, hift.pt, ...)"),
        Param("lm_precision", str, "fp32", "the LM's Linear layers: fp32, int8 (PyTorch dynamic INT8) or fp32-ort",
              ("fp32", "int8", "fp32-ort")),
        *(p for p in _TTS_SERVICE if p.name.startswith("max_text_")),
        Param("speakers_model", str, "", "the Triton model of registered CosyVoice3 speakers (speaker_id; empty: "
              "speaker_id is refused)"),
        _BLS_TIMEOUT,
        *_CV3_COMMON,
        *(replace(p, doc=_CV3_STREAM_STATE_DOCS[p.name]) for p in _STREAM_STATE if p.name in _CV3_STREAM_STATE_DOCS),
)

MODEL_PARAMS: Mapping[str, tuple[Param, ...]] = MappingProxyType({
    "graph": (
        Param("graph", str, None, "the graph of cosyvoice_triton.shapes.GRAPHS (or GRAPHS3) this model runs"),
        Param("runtime", str, "onnxruntime", "onnxruntime (the ONNX file) or torch (the checkpoint's module)",
              ("onnxruntime", "torch")),
        Param("onnx_path", str, "", "the graph's ONNX file (runtime onnxruntime; relative: in the version's folder)"),
        Param("model_dir", str, "", "the CosyVoice2 folder (runtime torch)"),
        Param("device", str, "cpu", "cpu or cuda[:N]"),
        _THREADS,
        _TORCH_THREADS,
        Param("graph_cache_mb", float, 0.0, "MiB of this model's cache of successful answers: a repeated request is "
              "answered without running the graph (0: off; rendered on the prompt-side graphs, tunable "
              "graph_cache_mb)"),
        _NICE,
    ),
    "preprocess": (
        Param("model_dir", str, None, "the CosyVoice2 folder (its cosyvoice2.yaml: mel settings, sample rate)"),
        Param("min_seconds", float, 0.1, "shortest accepted source / prompt"),
        Param("max_seconds", float, 30.0, "longest accepted source / prompt (the tokenizer's limit is 30 s)"),
        Param("vad_trim", bool, False, "trim non-speech at both ends of source and prompt (needs silero-vad)"),
        Param("denoise_prompt", bool, False, "stationary spectral-gating noise reduction of the prompt"),
        *_PROMPT_CACHE,
        _NICE,
    ),
    "flow": (
        Param("model_dir", str, None, "the CosyVoice2 folder (its cosyvoice2.yaml: CFM settings)"),
        Param("n_timesteps", int, 0, "Euler steps (0: the model's, 10)"),
        Param("encoder_model", str, "flow_encoder", "the Triton model of the flow_encoder graph"),
        Param("estimator_model", str, "flow_estimator", "the Triton model of the flow_estimator graph"),
        Param("pin_graph_version", bool, False, "call the graphs' version numbered as this model's (a versioned "
              "repository: cosyvoice_triton.serving.launch.rollout), else their latest"),
        _BLS_TIMEOUT,
        _TORCH_THREADS,
        _NICE,
    ),
    "hift": (
        Param("source_model", str, "hift_source", "the Triton model of the hift_source graph"),
        Param("decoder_model", str, "hift_decoder", "the Triton model of the hift_decoder graph"),
        Param("pin_graph_version", bool, False, "call the graphs' version numbered as this model's (a versioned "
              "repository: cosyvoice_triton.serving.launch.rollout), else their latest"),
        Param("default_seed", int, 0, "seed of the NSF noise when a request gives none"),
        _BLS_TIMEOUT,
        _TORCH_THREADS,
        _NICE,
    ),
    "postprocess": (
        Param("model_sample_rate", int, 24000, "rate of the vocoder's waveform"),
        *_OUTPUT,
        Param("output_format", str, "", "'' (no bytes), wav or flac: 16-bit file bytes in audio_bytes",
              ("", "wav", "flac")),
        _NICE,
    ),
    "cosyvoice_tts_stream": _TTS_SERVICE,
    "cosyvoice_tts": (
        Param("stream_model", str, "cosyvoice_tts_stream", "the decoupled TTS model each request is sent to"),
        Param("model_sample_rate", int, 24000, "rate of the stream model's waveform before post-processing"),
        *_OUTPUT,
        _BLS_TIMEOUT,
        _NICE,
    ),
    "cosyvoice2": (  # the official runtime's interface (serving/stages/official_api.py)
        Param("offline_model", str, "cosyvoice_tts", "the TTS model a request is sent to when not decoupled"),
        Param("stream_model", str, "cosyvoice_tts_stream", "the decoupled TTS model a request streams from"),
        Param("keep_empty_reference_text", bool, False, "pass an empty reference_text on as an empty prompt_text "
              "(CosyVoice3: zero-shot with the system prompt alone, as the official CosyVoice3 runtime) instead of "
              "speaking without a transcript"),
        Param("stream_schedule", str, "", "the streaming hops asked of stream_model (its stream_schedule input): "
              "runtime (the official CosyVoice3 Triton runtime's: 15, 25, 50, 100, ... tokens), official (the "
              "official CosyVoice3 class's); empty: the stream model's own, no input sent",
              ("", "official", "runtime")),
        _BLS_TIMEOUT,
    ),
    "speakers": (  # also cosyvoice3_speakers (family cosyvoice3)
        Param("model_dir", str, None, "the model folder (mel settings; CosyVoice-BlankEN/ for transcripts)"),
        Param("family", str, "cosyvoice2", "the folder's family: cosyvoice2 (its tokenizer and CAM++ are the graph "
              "models below, by BLS) or cosyvoice3 (speech_tokenizer_v3.onnx and campplus.onnx in process)",
              ("cosyvoice2", "cosyvoice3")),
        Param("speaker_dir", str, "build/speakers", "where speakers persist (relative: the server's work dir)"),
        Param("capacity", int, 1000, "most speakers kept (LRU in memory, persisted files)"),
        Param("min_seconds", float, 0.1, "shortest accepted prompt"),
        Param("max_seconds", float, 30.0, "longest accepted prompt"),
        Param("tokenizer_model", str, "speech_tokenizer", "the Triton model of the speech_tokenizer graph"),
        Param("speaker_encoder_model", str, "speaker_encoder", "the Triton model of the speaker_encoder graph"),
        *_PROMPT_CACHE,
        _BLS_TIMEOUT,
    ),
    "cosyvoice_vc_stream": (
        Param("model_dir", str, None, "the CosyVoice2 folder (its cosyvoice2.yaml: mel and CFM settings)"),
        Param("n_timesteps", int, 0, "Euler steps (0: the model's, 10)"),
        Param("default_seed", int, 0, "seed of the NSF noise when a request gives none"),
        Param("min_seconds", float, 0.1, "shortest accepted source / prompt"),
        Param("max_seconds", float, 30.0, "longest accepted source / prompt"),
        Param("speakers_model", str, "speakers", "the Triton model that holds the registered speakers"),
        Param("max_streams", int, 4, "streams running at once (worker threads)"),
        Param("max_waiting", int, 4, "streams waiting for a worker; beyond, refused at once (UNAVAILABLE)"),
        *_STREAM_SCHEDULE,
        *_OUTPUT,
        *_STREAM_STATE,
        _TORCH_THREADS,
        _BLS_TIMEOUT,
        *_PROMPT_CACHE,
    ),
    "cosyvoice_vc_live": (
        Param("model_dir", str, None, "the CosyVoice2 folder (its cosyvoice2.yaml: mel and CFM settings)"),
        Param("n_timesteps", int, 0, "Euler steps (0: the model's, 10)"),
        Param("default_seed", int, 0, "seed of the NSF noise when a stream gives none"),
        Param("min_seconds", float, 0.1, "shortest accepted prompt"),
        Param("max_seconds", float, 30.0, "longest accepted prompt"),
        Param("speakers_model", str, "speakers", "the Triton model that holds the registered speakers"),
        *_LIVE_SESSIONS,
        *_LIVE_VC,
        *_OUTPUT,
        *_STREAM_STATE,
        _TORCH_THREADS,
        _BLS_TIMEOUT,
        *_PROMPT_CACHE,
    ),
    "cosyvoice3_tts_stream": _CV3_TTS,  # a CosyVoice3 folder in process (serving/stages/cosyvoice3.py)
    "cosyvoice3_tts_live": (  # the same, the text in pieces
        *_CV3_TTS,
        *_LIVE_SESSIONS[:2],
        Param("text_timeout_s", float, 10.0, "a session whose text stops arriving this long ends with what it has "
              "(its audio is finished and sent)"),
        Param("max_token_text_ratio", float, 20.0, "the LM's step limit: most speech tokens per text token of a "
              "session (stop reason max_len beyond)"),
    ),
    "cosyvoice3_vc": (
        Param("model_dir", str, None, "the CosyVoice3 folder (flow.pt, hift.pt, speech_tokenizer_v3.onnx, ...)"),
        _BLS_TIMEOUT,
        *_CV3_COMMON,
    ),
    "cosyvoice3_vc_live": (  # the source in pieces (serving/stages/cosyvoice3_live_vc.py)
        Param("model_dir", str, None, "the CosyVoice3 folder (flow.pt, hift.pt, speech_tokenizer_v3.onnx, ...)"),
        Param("speakers_model", str, "", "the Triton model of registered CosyVoice3 speakers (speaker_id; empty: "
              "speaker_id is refused)"),
        _BLS_TIMEOUT,
        *_CV3_COMMON,
        *_LIVE_SESSIONS,
        *_LIVE_VC,
    ),
    "cosyvoice_tts_live": (
        *_TTS_SERVICE,
        *_LIVE_SESSIONS[:2],
        Param("text_timeout_s", float, 10.0, "a session whose text stops arriving this long ends with what it has "
              "(its audio is finished and sent)"),
        Param("max_token_text_ratio", float, 20.0, "the LM's step limit: most speech tokens per text token of a "
              "session (stop reason max_len beyond)"),
    ),
})
