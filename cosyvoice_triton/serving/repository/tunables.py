"""What a deployment may tune (:class:`Tunables`, :func:`parse_tunable`, the ``--set`` of every command line that
takes tunables: :class:`TunableAction`, the named profiles) and the config lines the task tunables make (batching and
priority, rate limiter, niceness, response cache)."""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ...errors import ConfigError
from ...frontend.text.frontend import MAX_DIGIT_RUN, MAX_DIGITS
from ...shapes import (
    GRAPHS,
)
from ...streaming import StreamSchedule
from ..stages.model_params import MODEL_PARAMS
from .served import (
    CV3_GRAPH_MODELS,
    HIGH_PRIORITY_MODELS,
    LEAF_MODELS,
    NICE_MODELS,
    RESPONSE_CACHE_GRAPHS,
    SERVED_NAMES,
    TASK_COPIES,
    TASK_SUFFIX,
)
from .templates import (
    RenderError,
)


@dataclass(frozen=True)
class Tunables:
    """What a deployment may tune; each ends up in a config field or ``parameters`` entry."""

    max_queue_delay_us: int = 2000  # dynamic batcher: how long a request waits for others
    max_queue_size: int = 64  # per model: requests beyond are rejected at once (UNAVAILABLE)
    queue_timeout_us: int = 120_000_000  # a request queued longer is rejected (0: no timeout)
    instances: Mapping[str, int] = field(default_factory=dict)  # model -> instance count (default 1)
    instance_kind: str = ""  # graphs of onnx / trt: KIND_GPU by default; local: KIND_CPU
    intra_op_threads: int = 1  # onnxruntime threads per local graph instance
    torch_threads: int = 1
    runtime: str = "onnxruntime"  # local graphs: onnxruntime or torch
    device: str = "cpu"  # local graphs: cpu or cuda
    n_timesteps: int = 0  # flow Euler steps (0: the model's)
    min_seconds: float = 0.1
    max_seconds: float = 30.0
    vad_trim: bool = False  # preprocess: Silero VAD trim of source and prompt (needs silero-vad)
    denoise_prompt: bool = False  # preprocess: spectral-gating noise reduction of the prompt
    prompt_cache_entries: int = 256  # preprocess, speakers: prompts kept by content hash (0: no prompt cache)
    prompt_cache_mb: float = 64.0  # preprocess, speakers: most MiB the prompt cache keeps
    #: Triton's response cache on the prompt-side graphs (:data:`RESPONSE_CACHE_GRAPHS`): MiB of the server's local
    #: cache (``--cache-config local,size=...``, which
    #: :class:`~cosyvoice_triton.serving.launch.server.TritonServer` passes from the marker); a repeated prompt's
    #: tokenizer and CAM++ requests are answered from it without running the graphs (0: off, the default: Triton 2.51
    #: caches error responses too, model_repository/README.md "Repeated prompts")
    response_cache_mb: float = 0.0
    #: Flavor local: MiB of the graph model's own cache of successful answers on each prompt-side graph
    #: (:data:`RESPONSE_CACHE_GRAPHS`, and their TTS copies): a repeated prompt's tokenizer and CAM++ requests are
    #: answered without running the graphs, and a refused or failed request is never kept (0: off; the native
    #: onnx / trt flavors run no Python, there only the response cache above exists)
    graph_cache_mb: float = 16.0
    default_seed: int = 0
    output_sample_rate: int = 0
    loudness_lufs: float = 0.0
    peak_dbfs: float = -1.0
    output_format: str = ""
    bls_timeout_us: int = 0
    warmup: bool = True
    #: Triton's dynamic batcher on every graph and stage (off: the default scheduler, one request per execution,
    #: and no queue policy: max_queue_delay_us, max_queue_size and queue_timeout_us then have no effect)
    dynamic_batching: bool = True
    tts: str = "auto"  # render the TTS models: auto (when the model folder has llm.pt), on, off
    max_active_requests: int = 8  # TTS: rows of the in-flight LM batch per instance
    max_waiting_requests: int = 16  # TTS: requests waiting for an LM row; beyond, refused at once (UNAVAILABLE)
    tts_wait_timeout_s: float = 60.0  # TTS: a request that waits longer for an LM row is refused
    max_text_chars: int = 2000  # TTS: longest accepted text
    max_text_digit_run: int = MAX_DIGIT_RUN  # TTS: longest run of digits (refused before number normalisation)
    max_text_digits: int = MAX_DIGITS  # TTS: most digits in one text
    #: GPU flavors: also render the TensorRT-LLM backend's ``tensorrt_llm`` model for the LM (``tensorrtllm``; its
    #: engine from ``<engine_dir>/llm``, see model_repository/README.md), or not (``python``: the in-process loop)
    lm_backend: str = "python"
    speaker_dir: str = "build/speakers"  # speakers: where registered speakers persist (relative: server work dir)
    speaker_capacity: int = 1000  # speakers: most speakers kept (LRU in memory, persisted files)
    vc_max_streams: int = 4  # cosyvoice_vc_stream: streams running at once
    vc_max_waiting: int = 4  # cosyvoice_vc_stream: streams waiting for a worker; beyond, refused at once (UNAVAILABLE)
    #: TTS: the LM's Linear layers in fp32, int8 (PyTorch's dynamic INT8 on the CPU: about 3-4x the decode rate,
    #: outside the quality bar of cosyvoice_triton.models.lm_quant, hence not the default) or fp32-ort (the same fp32
    #: on onnxruntime's MatMul, cosyvoice_triton.models.lm_ort: fp32's results; bench-tts' decode figures decide
    #: whether it becomes the default)
    lm_precision: str = "fp32"
    #: The streaming hops of cosyvoice_tts_stream and cosyvoice_vc_stream (cosyvoice_triton.streaming.StreamSchedule;
    #: the defaults are the official schedule): the first hop, the growth factor of the next ones, the largest
    stream_first_hop: int = 25
    stream_hop_growth: int = 2
    stream_max_hop: int = 100
    #: The streams' flow state (serving/stages/stream_state.py): cosyvoice_vc_stream, cosyvoice_tts_stream,
    #: cosyvoice_tts_live, cosyvoice3_tts_stream and cosyvoice3_tts_live compute each non-final chunk's new frames
    #: only, from the stream's cached keys/values (the checkpoint's PyTorch flow loaded in those models), instead of
    #: the flow (graphs) over every frame; the most MiB
    #: one stream holds and all the streams of an instance hold (beyond either, a stream recomputes from there on),
    #: and the MiB of registered speakers' settled prompt frames kept (0: off)
    stream_state: bool = True
    stream_state_mb: float = 2048.0
    stream_state_total_mb: float = 4096.0
    speaker_state_mb: float = 1024.0
    #: The live models (``cosyvoice_vc_live``; serving/stages/live.py, live_vc.py): sessions held at once (a stream
    #: beyond is refused at its start with UNAVAILABLE), pieces waiting per session (a faster sender's next piece is
    #: refused), the idle timeout that frees a session, and live VC's chunk, tokenizer window and flow window in
    #: speech tokens (40 ms each) and its largest piece
    live_max_sessions: int = 4
    live_max_queued: int = 8
    live_idle_timeout_s: float = 30.0
    live_chunk_tokens: int = 25
    live_tokenizer_context_tokens: int = 75
    live_tokenizer_lookahead_tokens: int = 5
    live_flow_context_tokens: int = 100
    live_max_piece_seconds: float = 5.0
    #: ``cosyvoice_tts_live`` (serving/stages/live_tts.py; rendered with the TTS models): sessions held at once (each
    #: runs its own LM decode), text pieces waiting per session (text comes faster than it is spoken; the text's
    #: max_text_chars bounds it too), the wait for the next piece after which a session ends with what it has, and
    #: the LM's step limit in speech tokens per text token
    live_tts_max_sessions: int = 2
    live_tts_max_queued: int = 512
    live_text_timeout_s: float = 10.0
    live_tts_max_token_text_ratio: float = 20.0
    #: Several tasks on one server (README "Sharing the machine"). ``priority_levels`` >= 2: every dynamic batcher
    #: gets that many levels (1 highest; a request's own ``priority`` overrides), each model's default level from
    #: ``task_priority`` (model -> level; unlisted models: the TTS entry models 1, the rest the lowest level)
    priority_levels: int = 0
    task_priority: Mapping[str, int] = field(default_factory=dict)
    #: Triton's rate limiter (serve with ``--rate-limit=execution_count``): model -> units of the resource
    #: ``task_quota`` each of its instances needs per execution; the server has as many units as the largest need
    #: (or ``--rate-limit-resource=task_quota:N``). Leaf models only (:data:`LEAF_MODELS`: the graphs, their TTS
    #: copies, preprocess, postprocess): on a BLS stage (flow, hift) the limiter stalled Triton 2.51 (an execution
    #: holding the unit waited for its callee, which the limiter no longer started: flow_estimator stopped; README).
    rate_limit: Mapping[str, int] = field(default_factory=dict)
    #: The TTS task's own copies of the stages it shares with VC: ``<graph>_tts`` of the six graphs and
    #: ``flow_tts`` / ``hift_tts`` (:data:`TASK_COPIES`), which ``cosyvoice_tts_stream`` calls instead of the
    #: originals, so a TTS call never queues behind VC work at a stage (BLS calls carry no priority in Triton 2.51).
    #: Off by default: a copy is one more Python stub process and one more copy of the weights per instance.
    task_isolation: bool = False
    #: The task whose models get priority level 1 by default when ``priority_levels`` is on: ``tts`` (the TTS entry
    #: models and the TTS copies) or ``vc`` (every other model)
    high_task: str = "tts"
    #: Per-task quota: > 0 puts every leaf model of the task that is NOT ``high_task`` (its graphs, or the TTS copies;
    #: VC also preprocess / postprocess) under the rate limiter, each instance needing 1 unit of ``task_quota``, so
    #: that task runs at most this many leaf executions at once (serve with ``--rate-limit=execution_count`` and, for
    #: a quota above 1, ``--rate-limit-resource=task_quota:N``); the high task's models are not rate limited.
    #: Needs ``task_isolation`` (without copies the leaf models are shared and the quota would bind both tasks).
    task_quota: int = 0
    #: > 0: the CPU niceness (1-19) of the processes of the task that is not ``high_task``: its Python models
    #: (graphs of flavor local, preprocess, flow, hift, postprocess; TTS: cosyvoice_tts_stream with its LM loop,
    #: cosyvoice_tts, the copies) call ``os.setpriority`` in ``initialize()``, so when both tasks want the CPU the
    #: kernel runs the high task first (the rate limiter does not see the LM loop or time outside ``execute``).
    #: Needs ``task_isolation`` (a shared stage would be slowed for both tasks).
    task_nice: int = 0
    #: ``cosyvoice2``, the official CosyVoice runtime's interface (rendered with the TTS models where they answer
    #: 24 kHz, as its clients assume): decoupled, chunks over a gRPC stream (the official default, client_grpc.py
    #: --mode streaming), or not, whole answers over HTTP and gRPC (client_http.py, client_grpc.py --mode offline)
    cosyvoice2_decoupled: bool = True
    #: A CosyVoice3 folder served beside the CosyVoice2 one (``""``: none): ``cosyvoice3_tts_stream``,
    #: ``cosyvoice3_tts_live``, ``cosyvoice3_tts``, ``cosyvoice3_vc``, ``cosyvoice3_speakers`` and, where the output
    #: is 24 kHz, ``cosyvoice3`` (the official runtime's CosyVoice3 interface); the folder's models in process, one
    #: request at a time per instance (serving/stages/cosyvoice3.py)
    cosyvoice3_dir: str = ""
    #: ``cosyvoice3``: decoupled (chunks over a gRPC stream, the official default) or whole answers
    cosyvoice3_decoupled: bool = True
    #: The CosyVoice3 flow's precision: ``fp32``, or ``int8`` (the DiT blocks' Linear layers on PyTorch's CPU INT8,
    #: within the quality report's bar: models/cosyvoice3/dit_quant.py)
    cosyvoice3_flow_precision: str = "fp32"
    #: ``cosyvoice3``'s streamed chunks: ``runtime``, the official CosyVoice3 Triton runtime's hops (15, 25, 50, 100,
    #: ... tokens, as its clients get them), or ``official``, the official ``CosyVoice3`` class's (those of
    #: ``cosyvoice3_tts_stream``: 25 + pad, 50, 100)
    cosyvoice3_stream_schedule: str = "runtime"
    #: The fp32 ONNX export of the ``cosyvoice3_dir`` folder (``export-onnx --model-dir <cosyvoice3_dir>``; ``""``:
    #: none): its DiT estimator graphs are served as ``flow3_estimator`` and ``flow3_estimator_streaming`` and its
    #: vocoder generator as ``hift3_decoder`` behind the dynamic batcher, and every CosyVoice3 model's flow steps and
    #: vocoder calls go to them by BLS, batched across instances (serving/stages/cosyvoice3_graphs.py); needs
    #: ``cosyvoice3_flow_precision=fp32``
    cosyvoice3_onnx_dir: str = ""
    #: The served vocoder graph ``hift3_decoder``: ``fp32`` (the export's), or ``int8_cpu``, its onnxruntime CPU INT8
    #: (``<cosyvoice3_onnx_dir>/int8_cpu``, written by ``quantize --model-dir <cosyvoice3_dir>``; flavor ``local``),
    #: taken only where its manifest records it within the quality bar and faster than fp32 (export/quantize3.py)
    cosyvoice3_vocoder_precision: str = "fp32"
    #: Requests one instance of each CosyVoice3 model computes at once (one copy of the weights; each answer is the
    #: one it gets alone); ``cosyvoice3_vc`` takes that many per execution, each in its own thread
    cosyvoice3_concurrency: int = 1

    def __post_init__(self):
        for name in ("max_queue_delay_us", "max_queue_size", "queue_timeout_us", "intra_op_threads",
                     "torch_threads", "n_timesteps", "bls_timeout_us", "output_sample_rate", "default_seed"):
            if int(getattr(self, name)) < 0:
                raise RenderError(f"tunable {name} must be >= 0, got {getattr(self, name)}")
        if self.max_queue_size < 1:
            raise RenderError("tunable max_queue_size must be >= 1")
        for name in ("response_cache_mb", "graph_cache_mb", "stream_state_mb", "stream_state_total_mb",
                     "speaker_state_mb"):
            if getattr(self, name) < 0:
                raise RenderError(f"tunable {name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.runtime not in MODEL_PARAMS["graph"][1].choices:
            raise RenderError(f"tunable runtime must be one of {MODEL_PARAMS['graph'][1].choices}, got "
                              f"{self.runtime!r}")
        if self.instance_kind not in ("", "KIND_CPU", "KIND_GPU"):
            raise RenderError(f"tunable instance_kind must be KIND_CPU or KIND_GPU, got {self.instance_kind!r}")
        if self.lm_backend not in ("python", "tensorrtllm"):
            raise RenderError(f"tunable lm_backend must be python or tensorrtllm, got {self.lm_backend!r}")
        if self.tts not in ("auto", "on", "off"):
            raise RenderError(f"tunable tts must be auto, on or off, got {self.tts!r}")
        if self.cosyvoice3_stream_schedule not in ("official", "runtime"):
            raise RenderError(f"tunable cosyvoice3_stream_schedule must be official or runtime, got "
                              f"{self.cosyvoice3_stream_schedule!r}")
        if int(self.cosyvoice3_concurrency) < 1:
            raise RenderError(f"tunable cosyvoice3_concurrency must be >= 1, got {self.cosyvoice3_concurrency}")
        if self.cosyvoice3_onnx_dir and self.cosyvoice3_flow_precision != "fp32":
            raise RenderError("tunable cosyvoice3_onnx_dir serves the fp32 estimator graphs: it needs "
                              f"cosyvoice3_flow_precision=fp32, got {self.cosyvoice3_flow_precision!r}")
        if self.cosyvoice3_vocoder_precision not in ("fp32", "int8_cpu"):
            raise RenderError(f"tunable cosyvoice3_vocoder_precision must be fp32 or int8_cpu, got "
                              f"{self.cosyvoice3_vocoder_precision!r}")
        if self.cosyvoice3_vocoder_precision != "fp32" and not self.cosyvoice3_onnx_dir:
            raise RenderError("tunable cosyvoice3_vocoder_precision=int8_cpu picks the served vocoder graph: it needs "
                              "cosyvoice3_onnx_dir")
        if self.cosyvoice3_flow_precision not in ("fp32", "int8"):
            raise RenderError(f"tunable cosyvoice3_flow_precision must be fp32 or int8, got "
                              f"{self.cosyvoice3_flow_precision!r}")
        if self.lm_precision not in ("fp32", "int8", "fp32-ort"):
            raise RenderError(f"tunable lm_precision must be fp32 or int8 (PyTorch) or fp32-ort (onnxruntime), got "
                              f"{self.lm_precision!r}")
        try:
            self.stream_schedule()
        except ConfigError as exc:
            raise RenderError(f"tunables stream_*: {exc}") from exc
        for name in ("max_active_requests", "max_text_chars", "max_text_digit_run", "max_text_digits"):
            if int(getattr(self, name)) < 1:
                raise RenderError(f"tunable {name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests < 0 or not self.tts_wait_timeout_s > 0:
            raise RenderError("tunables max_waiting_requests must be >= 0 and tts_wait_timeout_s > 0")
        if self.output_format not in ("", "wav", "flac"):
            raise RenderError(f"tunable output_format must be '', wav or flac, got {self.output_format!r}")
        for model, n in self.instances.items():
            if model not in (*GRAPHS, *CV3_GRAPH_MODELS, *SERVED_NAMES, *TASK_COPIES):
                raise RenderError(f"tunable instances: unknown model {model!r}")
            if int(n) < 1:
                raise RenderError(f"tunable instances[{model!r}] must be >= 1, got {n}")
        if self.priority_levels == 1 or self.priority_levels < 0:
            raise RenderError(f"tunable priority_levels must be 0 (off) or >= 2, got {self.priority_levels}")
        if self.high_task not in ("tts", "vc"):
            raise RenderError(f"tunable high_task must be tts or vc, got {self.high_task!r}")
        if self.task_quota < 0 or (self.task_quota and not self.task_isolation):
            raise RenderError(f"tunable task_quota must be >= 0 and needs task_isolation=true (got task_quota="
                              f"{self.task_quota}, task_isolation={self.task_isolation}): without the TTS copies the "
                              "leaf models are shared and a quota on them would bind both tasks")
        if not 0 <= self.task_nice <= 19 or (self.task_nice and not self.task_isolation):
            raise RenderError(f"tunable task_nice must be in 0..19 and needs task_isolation=true, got task_nice="
                              f"{self.task_nice}, task_isolation={self.task_isolation}")
        for tunable, limit in (("task_priority", self.priority_levels), ("rate_limit", 1 << 30)):
            for model, n in getattr(self, tunable).items():
                if tunable == "rate_limit" and model not in LEAF_MODELS:
                    raise RenderError(f"tunable rate_limit: {model!r} is not a graph or another leaf model "
                                      f"({', '.join(LEAF_MODELS)}): a model that calls others must not hold the rate "
                                      "limiter's unit (it stalls)")
                if model in TASK_COPIES and not self.task_isolation:
                    raise RenderError(f"tunable {tunable}: {model!r} is rendered only with task_isolation=true")
                if model not in (*GRAPHS, *CV3_GRAPH_MODELS, *SERVED_NAMES, *TASK_COPIES):
                    raise RenderError(f"tunable {tunable}: unknown model {model!r}")
                if not 1 <= int(n) <= limit:
                    raise RenderError(f"tunable {tunable}[{model!r}] must be in 1..{limit}, got {n}")


    def stream_schedule(self) -> StreamSchedule:
        return StreamSchedule(self.stream_first_hop, self.stream_hop_growth, self.stream_max_hop)

    def stream_state_params(self) -> dict[str, Any]:
        return {"stream_state": self.stream_state, "stream_state_mb": self.stream_state_mb,
                "stream_state_total_mb": self.stream_state_total_mb, "speaker_state_mb": self.speaker_state_mb,
                "device": self.device}

    def cv3_stream_state_params(self) -> dict[str, Any]:
        """What CosyVoice3's streaming models read of the stream state (no speaker state, no device: their flow is
        the instance's)."""
        return {"stream_state": self.stream_state, "stream_state_mb": self.stream_state_mb,
                "stream_state_total_mb": self.stream_state_total_mb}

    def stream_params(self) -> dict[str, int]:
        return {"stream_first_hop": self.stream_first_hop, "stream_hop_growth": self.stream_hop_growth,
                "stream_max_hop": self.stream_max_hop}


#: The "plain" deployment: what a team that wraps the official code would serve. No dynamic batching (one request
#: per execution) and the graphs as the checkpoint's PyTorch fp32 modules inside the Python backend (flavor
#: ``local``, precision ``fp32``; the shipped ``speech_tokenizer`` / ``speaker_encoder`` ONNX files stay on
#: onnxruntime). Its client runs the stages one request at a time:
#: :class:`cosyvoice_triton.clients.plain.PlainPipeline`.
PLAIN_TUNABLES: Mapping[str, Any] = MappingProxyType({"dynamic_batching": False, "runtime": "torch",
                                                      "response_cache_mb": 0.0, "graph_cache_mb": 0.0})
#: Named tunable sets of :func:`render_repository` (``profile=``) and ``render.py --profile``.
PROFILES: Mapping[str, Mapping[str, Any]] = MappingProxyType({"plain": PLAIN_TUNABLES})
_PROFILE_NOTES = {
    "plain": "no dynamic batching, PyTorch fp32 graphs; client: cosyvoice_triton.clients.plain.PlainPipeline",
}


def _tts_task(name: str) -> bool:
    return name in HIGH_PRIORITY_MODELS or name in TASK_COPIES


def _priority_lines(tun: Tunables, name: str) -> str:
    if not tun.priority_levels:
        return ""
    high = _tts_task(name) == (tun.high_task == "tts")
    default = tun.task_priority.get(name, 1 if high else tun.priority_levels)
    return f"  priority_levels: {tun.priority_levels}\n  default_priority_level: {default}\n"


#: ``task_quota``: the rate limiter's priority (a weight) of the low task's instances.
LOW_TASK_RATE_PRIORITY = 1000


def _low_task(tun: Tunables, name: str) -> bool:
    return _tts_task(name) == (tun.high_task == "vc")


def _nice(tun: Tunables, name: str) -> dict[str, int]:
    """The ``nice`` parameter of ``name`` (``task_nice`` on the low task's Python models), or nothing."""
    base = name.removesuffix(TASK_SUFFIX) if name in TASK_COPIES else name
    python = base in NICE_MODELS or base in GRAPHS or base in CV3_GRAPH_MODELS
    return {"nice": tun.task_nice} if tun.task_nice and python and _low_task(tun, name) else {}


def _quota_need(tun: Tunables, name: str) -> int:
    """Units of ``task_quota`` an instance of ``name`` needs: ``rate_limit``'s, else 1 for a leaf model of the task
    that is not ``high_task`` when ``task_quota`` is on."""
    if name in tun.rate_limit:
        return int(tun.rate_limit[name])
    return 1 if tun.task_quota and name in LEAF_MODELS and _low_task(tun, name) else 0


def _instance_count(tun: Tunables, name: str, count: int) -> str:
    """The instance group's count, with the rate limiter's resource need of ``name`` when it has one."""
    need = _quota_need(tun, name)
    if not need:
        return str(count)
    # Triton 2.51 keeps the instances waiting for the limiter in ONE queue ordered by executions x priority and
    # starts only its head: an unlimited (high task) instance behind a low instance waiting for its unit waits too
    # (measured: flow_estimator_tts queued 262 ms per call under a VC flood). The low task's weight keeps it behind.
    weight = f" priority: {LOW_TASK_RATE_PRIORITY}" if tun.task_quota and name not in tun.rate_limit else ""
    return f'{count} rate_limiter {{ resources [ {{ name: "task_quota" count: {need} }} ]{weight} }}'


def _response_cache_block(tun: Tunables, name: str) -> str:
    return "response_cache { enable: true }" if tun.response_cache_mb > 0 and name in RESPONSE_CACHE_GRAPHS else ""


def _dynamic_batching_block(tun: Tunables, name: str = "") -> str:
    """The ``dynamic_batching`` block of a graph or stage config, or (batching off) a comment saying so."""
    if not tun.dynamic_batching:
        return ("# no dynamic_batching (tunable dynamic_batching=false): the default scheduler runs one request per\n"
                "# execution; queued requests wait without a delay, size or timeout policy")
    return (f"dynamic_batching {{\n  max_queue_delay_microseconds: {tun.max_queue_delay_us}\n"
            f"{_priority_lines(tun, name)}  default_queue_policy {{\n    timeout_action: REJECT\n"
            f"    default_timeout_microseconds: {tun.queue_timeout_us}\n    allow_timeout_override: true\n"
            f"    max_queue_size: {tun.max_queue_size}\n  }}\n}}")


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
#: A comma starts another tunable only before ``NAME=``, so a mapping's own commas (``instances=flow:2,hift:2``) stay
#: in its value.
_NEXT_TUNABLE = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*=)")


def parse_tunable(text: str) -> tuple[str, Any]:
    """``"NAME=VALUE"`` -> (name, typed value) for a field of :class:`Tunables` (``instances=flow:2,hift:2``,
    ``warmup=false``, ``max_queue_delay_us=5000``); :class:`RenderError` names what is wrong otherwise (an unknown
    name with the closest known ones and every known one, a value that is not of the field's type)."""
    name, sep, value = text.partition("=")
    name = name.strip()
    types = {f.name: str(f.type) for f in fields(Tunables)}
    if not sep or name not in types:
        close = difflib.get_close_matches(name, types, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        what = f"unknown tunable {name!r}{hint}" if sep else "expected NAME=VALUE"
        raise RenderError(f"tunable {text!r}: {what} (NAME one of {', '.join(sorted(types))})")
    kind = types[name]
    several = ("; several tunables go as --set A=1,B=2 or --set A=1 B=2" if "," in value and "Mapping" not in kind
               else "")
    try:
        if "Mapping" in kind:
            return name, {k.strip(): int(v) for k, v in (p.split(":") for p in value.split(",") if p.strip())}
        if kind == "bool":
            if value.strip().lower() not in _BOOLS:
                raise ValueError(f"{value!r} is none of {', '.join(_BOOLS)}")
            return name, _BOOLS[value.strip().lower()]
        if kind in ("int", "float"):
            try:
                number = json.loads(value)
            except ValueError:
                number = None
            if isinstance(number, float) and kind == "int" and number.is_integer():
                number = int(number)  # 1e6
            if not isinstance(number, (int, float)) or isinstance(number, bool) or (kind == "int"
                                                                                    and isinstance(number, float)):
                raise ValueError(f"{value!r} is not {'an integer' if kind == 'int' else 'a number'}")
            return name, number
    except ValueError as exc:
        raise RenderError(f"tunable {text!r}: not a valid {kind} ({exc}){several}") from exc
    return name, value


def split_tunables(text: str) -> list[str]:
    """``"a=1,b=2"`` -> ``["a=1", "b=2"]``; ``"instances=flow:2,hift:2"`` stays one."""
    return [part.strip() for part in _NEXT_TUNABLE.split(text) if part.strip()]


def parse_tunables(texts: Iterable[str]) -> list[tuple[str, Any]]:
    """Every ``NAME=VALUE`` of ``texts``, each of which may hold several (:func:`split_tunables`), typed by
    :func:`parse_tunable`."""
    return [parse_tunable(part) for text in texts for part in split_tunables(text)]


class TunableAction(argparse.Action):
    """``--set`` as every command line here takes it: ``--set a=1 --set b=2``, ``--set a=1,b=2`` and ``--set a=1 b=2``
    alike; the destination gets the (name, typed value) pairs in order (a dict of them is the tunables), and a bad
    one is the parser's error, naming the tunable and what is wrong with it."""

    def __init__(self, option_strings, dest, nargs="+", metavar="NAME=VALUE", **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, metavar=metavar, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            parsed = parse_tunables([values] if isinstance(values, str) else values)
        except RenderError as exc:
            raise argparse.ArgumentError(self, str(exc)) from exc
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *parsed])


#: The help of ``--set`` (render, the load test, the soak).
SET_HELP = ("a render tunable, NAME=VALUE (Tunables in cosyvoice_triton/serving/repository/tunables.py; "
            "model_repository/README.md): repeat --set, or give several as --set A=1,B=2 or --set A=1 B=2; "
            "instances=flow:2,hift:2")
