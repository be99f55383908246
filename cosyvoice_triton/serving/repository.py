"""Render the Triton model repository (``build/model_repository``) from ``model_repository/`` and ``ensemble/``.

Two source folders, one served repository: ``model_repository/`` holds the stage models (a template per kind:
``graph/config.pbtxt.in`` for the six exported graphs, ``stage/config.pbtxt.in`` for every Python model, and
the thin ``model.py`` adapters); ``ensemble/`` holds the pipelines, one folder each (``cosyvoice_vc``: an
ensemble's ``config.pbtxt.in``; BLS orchestrators: a ``model.py``). Everything else is derived here: tensor
names, dtypes, dims and max batch sizes from :data:`~cosyvoice_triton.shapes.GRAPHS` and the table
:data:`SERVED_MODELS` (one row per non-graph model: folder, template, tensors, decoupled flag, instances,
parameters), config ``parameters`` declared in :data:`~cosyvoice_triton.serving.model_params.MODEL_PARAMS`.

Templates use ``${name}`` placeholders and are strict: a placeholder without a value, a value without a
placeholder, or a ``$`` that is not a well-formed placeholder is an error (:class:`RenderError`). The output
folder is rendered anew each time (a folder that this module did not write is never deleted).

Flavors:

* ``local``: every model on the Python backend; the graphs run on onnxruntime on the CPU from
  ``<onnx_dir>/<precision>`` (or, ``runtime="torch"``, as the checkpoint's PyTorch modules, e.g. on CUDA where
  there is a GPU but no TensorRT). Runs with the ``tritonserver`` of the ``nvidia-pytriton`` wheel.
* ``onnx``: the graphs on Triton's native ``onnxruntime`` backend (the NGC image), ONNX files copied in.
* ``trt``: the graphs on ``tensorrt_plan`` from ``<engine_dir>/<precision>/<graph>.plan``, except those
  :data:`cosyvoice_triton.export.trt.EXCLUDED` keeps on onnxruntime (``hift_source``: float64; ``speech_tokenizer``).

The rows of :data:`SERVED_MODELS` (the stages ``preprocess``, ``flow``, ``hift``, ``postprocess``, the
``cosyvoice_vc`` ensemble, the TTS pipelines) are the same in every flavor; ``flow`` and ``hift`` reach the graphs
by BLS.

Precision (``precision=``, :func:`precision_plan`): one of :data:`PRECISIONS` for every graph (``int8_cpu``, the
onnxruntime CPU INT8 graphs, in flavor ``local`` only), ``cpu-choice`` (per graph, the CPU decision of the quality
report, ``make quality``) or ``GRAPH=PRECISION,...``. The configs' comments and the marker's ``graph_precisions``
record what each graph got.

Profiles (``profile=``, ``render.py --profile``) are named sets of tunables: ``plain`` (:data:`PLAIN_TUNABLES`) is
the baseline deployment of the load tests, flavor ``local`` without dynamic batching and with the PyTorch fp32
graphs, whose client calls the stages one request at a time (:mod:`cosyvoice_triton.clients.plain`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..export.trt import EXCLUDED
from ..export.trt import ONNX_FALLBACK as TRT_ONNX_FALLBACK
from ..export.trt import PRECISIONS as TRT_PRECISIONS
from ..shapes import (
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
    VC_INPUTS,
    VC_MODEL,
    VC_OPTIONAL_INPUTS,
    VC_OUTPUTS,
    TensorSpec,
)
from ..streaming import StreamSchedule
from .live_tts import LIVE_TTS_INPUTS, LIVE_TTS_MODEL, LIVE_TTS_OUTPUTS
from .live_vc import LIVE_VC_INPUTS, LIVE_VC_MODEL, LIVE_VC_OUTPUTS, LiveSettings
from .marker import MARKER
from .model_params import MODEL_PARAMS
from .official_api import OFFICIAL_INPUTS, OFFICIAL_MODEL, OFFICIAL_OPTIONAL, OFFICIAL_OUTPUTS, OUTPUT_SAMPLE_RATE
from .rollout import MANIFEST_NAME as VERSION_MANIFEST
from .rollout import ROUTER_PARAMS, VERSIONED, VersionSpec, version_manifest
from .rollout import pipeline_model as _pipeline_model
from .speakers import SPEAKER_INPUTS, SPEAKER_OUTPUTS
from .vc_stream import VC_STREAM_INPUTS, VC_STREAM_MODEL, VC_STREAM_OUTPUTS
from .warmup import stage_warmup_samples

log = logging.getLogger(__name__)

__all__ = ["CPU_CHOICE", "DEFAULT_QUALITY_REPORT", "FLAVORS", "FLAVOR_PRECISIONS", "MARKER", "PLAIN_TUNABLES",
           "PRECISIONS", "PROFILES", "PrecisionPlan", "RenderError", "RenderReport", "Tunables",
           "default_templates_dir", "parse_precision_mapping", "parse_tunable", "precision_plan", "read_cpu_choice",
           "render_repository", "render_template"]

FLAVORS = ("local", "onnx", "trt")
STAGE_MODELS = ("preprocess", "flow", "hift", "postprocess")
_PLACEHOLDER = re.compile(r"\$\{([a-z_][a-z0-9_]*)\}")
_DTYPES = {"float32": "TYPE_FP32", "int32": "TYPE_INT32", "int64": "TYPE_INT64", "uint64": "TYPE_UINT64",
           "bool": "TYPE_BOOL", "bytes": "TYPE_STRING"}
AUDIO_BYTES = TensorSpec("audio_bytes", "bytes", ("batch", 1))


class RenderError(ValueError):
    """A template, tunable or input file that does not allow rendering the repository."""


def default_templates_dir() -> Path:
    """``model_repository/`` of the source tree this package lives in (``$COSYVOICE_TEMPLATES`` overrides)."""
    env = os.environ.get("COSYVOICE_TEMPLATES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "model_repository"


def render_template(text: str, values: Mapping[str, Any], *, source: str = "template") -> str:
    """Substitute ``${name}`` placeholders; every placeholder needs a value and every value a placeholder."""
    used = set(_PLACEHOLDER.findall(text))
    stray = [m.start() for m in re.finditer(r"\$", text) if not _PLACEHOLDER.match(text, m.start())]
    if stray:
        line = text.count("\n", 0, stray[0]) + 1
        raise RenderError(f"{source}:{line}: '$' that is not a ${{name}} placeholder (lower_snake names only)")
    missing = sorted(used - set(values))
    if missing:
        raise RenderError(f"{source}: no value for placeholder(s) {', '.join(missing)}")
    leftover = sorted(set(values) - used)
    if leftover:
        raise RenderError(f"{source}: value(s) {', '.join(leftover)} have no placeholder in the template")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


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
    #: cache (``--cache-config local,size=...``, which :class:`~.server.TritonServer` passes from the marker); a
    #: repeated prompt's tokenizer and CAM++ requests are answered from it without running the graphs (0: off, the
    #: default: Triton 2.51 caches error responses too, model_repository/README.md "Repeated prompts")
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
    #: GPU flavors: also render the TensorRT-LLM backend's ``tensorrt_llm`` model for the LM (``tensorrtllm``; its
    #: engine from ``<engine_dir>/llm``, see model_repository/README.md), or not (``python``: the in-process loop)
    lm_backend: str = "python"
    speaker_dir: str = "build/speakers"  # speakers: where registered speakers persist (relative: server work dir)
    speaker_capacity: int = 1000  # speakers: most speakers kept (LRU in memory, persisted files)
    vc_max_streams: int = 4  # cosyvoice_vc_stream: streams running at once
    vc_max_waiting: int = 4  # cosyvoice_vc_stream: streams waiting for a worker; beyond, refused at once (UNAVAILABLE)
    #: TTS: the LM's Linear layers in fp32 or int8 (PyTorch's dynamic INT8 on the CPU: about 3-4x the decode rate,
    #: outside the quality bar of cosyvoice_triton.models.lm_quant, hence not the default)
    lm_precision: str = "fp32"
    #: The streaming hops of cosyvoice_tts_stream and cosyvoice_vc_stream (cosyvoice_triton.streaming.StreamSchedule;
    #: the defaults are the official schedule): the first hop, the growth factor of the next ones, the largest
    stream_first_hop: int = 25
    stream_hop_growth: int = 2
    stream_max_hop: int = 100
    #: The live models (``cosyvoice_vc_live``; serving/live.py, live_vc.py): sessions held at once (a stream beyond
    #: is refused at its start with UNAVAILABLE), pieces waiting per session (a faster sender's next piece is
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
    #: ``cosyvoice_tts_live`` (serving/live_tts.py; rendered with the TTS models): sessions held at once (each runs
    #: its own LM decode), text pieces waiting per session (text comes faster than it is spoken; the text's
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

    def __post_init__(self):
        for name in ("max_queue_delay_us", "max_queue_size", "queue_timeout_us", "intra_op_threads",
                     "torch_threads", "n_timesteps", "bls_timeout_us", "output_sample_rate", "default_seed"):
            if int(getattr(self, name)) < 0:
                raise RenderError(f"tunable {name} must be >= 0, got {getattr(self, name)}")
        if self.max_queue_size < 1:
            raise RenderError("tunable max_queue_size must be >= 1")
        for name in ("response_cache_mb", "graph_cache_mb"):
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
        if self.lm_precision not in ("fp32", "int8"):
            raise RenderError(f"tunable lm_precision must be fp32 or int8, got {self.lm_precision!r}")
        try:
            self.stream_schedule()
        except ConfigError as exc:
            raise RenderError(f"tunables stream_*: {exc}") from exc
        for name in ("max_active_requests", "max_text_chars"):
            if int(getattr(self, name)) < 1:
                raise RenderError(f"tunable {name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests < 0 or not self.tts_wait_timeout_s > 0:
            raise RenderError("tunables max_waiting_requests must be >= 0 and tts_wait_timeout_s > 0")
        if self.output_format not in ("", "wav", "flac"):
            raise RenderError(f"tunable output_format must be '', wav or flac, got {self.output_format!r}")
        for model, n in self.instances.items():
            if model not in (*GRAPHS, *SERVED_NAMES, *TASK_COPIES):
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
                if model not in (*GRAPHS, *SERVED_NAMES, *TASK_COPIES):
                    raise RenderError(f"tunable {tunable}: unknown model {model!r}")
                if not 1 <= int(n) <= limit:
                    raise RenderError(f"tunable {tunable}[{model!r}] must be in 1..{limit}, got {n}")


    def stream_schedule(self) -> StreamSchedule:
        return StreamSchedule(self.stream_first_hop, self.stream_hop_growth, self.stream_max_hop)

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


@dataclass
class RenderReport:
    flavor: str
    out_dir: Path
    models: dict[str, str]  # model -> backend / platform
    files: list[Path]
    profile: str = ""  # a name of PROFILES, or "" (the tunables as given)

    def describe(self) -> str:
        what = f"flavor {self.flavor}" + (f", profile {self.profile}: {_PROFILE_NOTES[self.profile]}"
                                          if self.profile else "")
        lines = [f"rendered {self.out_dir} ({what}):"]
        lines += [f"  {m:<18} {b}" for m, b in self.models.items()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------- pbtxt blocks


def _dims(t: TensorSpec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in t.shape[1:]]


def _tensor_entry(t: TensorSpec, *, ragged: bool = False, optional: bool = False) -> str:
    dims = _dims(t)
    parts = [f'name: "{t.name}"', f"data_type: {_DTYPES[t.dtype]}"]
    if not dims:  # a [batch] tensor of the spec: [batch, 1] in requests, reshaped for the model
        parts += ["dims: [ 1 ]", "reshape: { shape: [ ] }"]
    else:
        parts.append(f"dims: [ {', '.join(map(str, dims))} ]")
    if ragged:
        parts.append("allow_ragged_batch: true")
    if optional:
        parts.append("optional: true")
    return "  { " + " ".join(parts) + " }"


def _io_block(kind: str, tensors: Iterable[TensorSpec], *, ragged: bool = False,
              optional: Iterable[str] = ()) -> str:
    optional = set(optional)
    entries = [_tensor_entry(t, ragged=ragged and kind == "input", optional=t.name in optional) for t in tensors]
    return f"{kind} [\n" + ",\n".join(entries) + "\n]"


def _parameters_block(params: Mapping[str, Any]) -> str:
    if not params:
        return ""
    lines = []
    for k, v in params.items():
        text = ("true" if v else "false") if isinstance(v, bool) else str(v)
        lines.append(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(text)} }} }}')
    return "\n".join(lines)


def _warmup_block(samples: Mapping[str, np.ndarray], batch: int) -> str:
    inputs = []
    for name, arr in samples.items():
        dims = list(arr.shape) or [1]
        dtype = _DTYPES[str(arr.dtype) if arr.dtype != np.bool_ else "bool"]
        inputs.append(f'    inputs {{ key: "{name}" value: {{ data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] '
                      f'input_data_file: "{name}" }} }}')
    return ("model_warmup [\n  {\n    name: \"sample\"\n    batch_size: " + str(batch) + "\n"
            + "\n".join(inputs) + "\n  }\n]")


#: The TTS entry models: priority level 1 by default when ``priority_levels`` is on and ``high_task`` is tts (the
#: rest: the lowest level).
HIGH_PRIORITY_MODELS = (TTS_STREAM_MODEL, TTS_MODEL)
#: ``task_isolation``: the stages TTS shares with VC, copied for TTS under ``<name>`` + :data:`TASK_SUFFIX`.
TASK_SUFFIX = "_tts"
ISOLATED_STAGES = ("flow", "hift")
TASK_COPIES = tuple(f"{m}{TASK_SUFFIX}" for m in (*GRAPHS, *ISOLATED_STAGES))
#: Models that call no other model: the only ones the rate limiter may hold (no hold-and-wait).
LEAF_MODELS = (*GRAPHS, *(f"{g}{TASK_SUFFIX}" for g in GRAPHS), "preprocess", "postprocess")


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
#: The Python models that read the ``nice`` parameter (and the graphs of flavor local).
NICE_MODELS = ("preprocess", "flow", "hift", "postprocess", TTS_STREAM_MODEL, TTS_MODEL)


def _low_task(tun: Tunables, name: str) -> bool:
    return _tts_task(name) == (tun.high_task == "vc")


def _nice(tun: Tunables, name: str) -> dict[str, int]:
    """The ``nice`` parameter of ``name`` (``task_nice`` on the low task's Python models), or nothing."""
    base = name.removesuffix(TASK_SUFFIX) if name in TASK_COPIES else name
    python = base in NICE_MODELS or base in GRAPHS
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



#: The graphs that get ``response_cache { enable: true }`` when ``response_cache_mb`` > 0, and (flavor local) the
#: parameter ``graph_cache_mb`` (their own cache of successful answers, tunable ``graph_cache_mb``): the prompt side of
#: ``cosyvoice_vc`` (a repeated prompt's features are byte-identical, so its requests hit). The tokenizer's source
#: requests go through the cache too (misses; small entries: the tokens).
RESPONSE_CACHE_GRAPHS = ("speech_tokenizer", "speaker_encoder")


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


def _write_warmup(model_dir: Path, samples: Mapping[str, np.ndarray]) -> list[Path]:
    out = model_dir / "warmup"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, arr in samples.items():
        path = out / name
        path.write_bytes(np.ascontiguousarray(arr).tobytes())
        files.append(path)
    return files


def graph_warmup_samples(name: str) -> tuple[dict[str, np.ndarray], int]:
    """Deterministic warm-up inputs of a graph (one sample without batch axis, and the batch size): short
    lengths within the spec's ranges, lengths consistent with the data."""
    spec = GRAPHS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    sizes = {axis: max(r.min, min(r.max, 64)) for axis, r in spec.axes.items()}
    batch = spec.axes["batch"].min
    samples = {}
    for t in spec.inputs:
        shape = spec.resolve(t, sizes)[1:]
        if t.dtype == "bool":
            arr = np.zeros(shape, bool)
        elif t.name == "lookahead_len":
            arr = np.zeros(shape or (1,), np.int32)
        elif t.name.endswith("_len"):
            axis = {"whisper_mel_len": "whisper_frames", "speech_token_len": "tokens"}[t.name]
            arr = np.full(shape or (1,), sizes[axis], np.int32)
        elif t.dtype == "int32":
            arr = rng.integers(0, 100, shape).astype(np.int32)
        elif t.name == "mask":
            arr = np.ones(shape, np.float32)
        elif t.name == "t":
            arr = np.full(shape or (1,), 0.5, np.float32)
        else:
            arr = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        samples[t.name] = arr
    return samples, batch


# ------------------------------------------------------------------------------------------- rendering
# precision per graph

#: Precisions a graph can be served in: the TensorRT ones (:data:`cosyvoice_triton.export.trt.PRECISIONS`) and
#: ``int8_cpu``, onnxruntime's CPU INT8 kernels (``build/onnx/int8_cpu``: MatMulInteger, QLinearConv), which only
#: the ``local`` flavor serves (on a GPU, TensorRT takes the explicit Q/DQ ``int8`` graphs instead).
PRECISIONS = (*TRT_PRECISIONS, "int8_cpu")
FLAVOR_PRECISIONS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "local": PRECISIONS, "onnx": TRT_PRECISIONS, "trt": TRT_PRECISIONS})
#: ONNX folders tried, in order, when one precision is asked for every graph (an explicit per-graph choice
#: takes its own folder or fails). ``int8_cpu`` falls back to fp32 only: fp16 runs slower on a CPU.
ONNX_FALLBACK: Mapping[str, tuple[str, ...]] = MappingProxyType({**TRT_ONNX_FALLBACK, "int8_cpu": ("int8_cpu", "fp32")})
#: ``precision`` value that reads the CPU precision per graph from the quality report's decisions.
CPU_CHOICE = "cpu-choice"
DEFAULT_QUALITY_REPORT = "build/quality/report.json"
#: Graphs whose ONNX file is always the fp32 one, whatever the precision (phase accumulation in float64/32).
FP32_ONLY = ("hift_source",)
#: Graphs that ``runtime=torch`` (flavor local) runs as the checkpoint's PyTorch modules instead of ONNX.
TORCH_GRAPHS = ("flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision asked of each graph: ``graphs`` (graph -> precision); ``strict``: a per-graph choice, whose
    file must exist (no fallback); ``source``: where the choice comes from, for the configs' notes."""

    graphs: Mapping[str, str]
    strict: bool
    source: str

    def describe(self, graph: str) -> str:
        return f"{self.graphs[graph]} ({self.source})"


def _check_allowed(graph: str, precision: str, flavor: str) -> None:
    if precision not in PRECISIONS:
        raise RenderError(f"precision of {graph}: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision not in FLAVOR_PRECISIONS[flavor]:
        raise RenderError(f"precision {precision} ({graph}): int8_cpu is onnxruntime's CPU INT8, served by the local "
                          f"flavor only; flavor {flavor} serves {', '.join(FLAVOR_PRECISIONS[flavor])} (int8: the "
                          "Q/DQ graphs)")


def _per_graph(choice: Mapping[str, str], flavor: str, source: str) -> PrecisionPlan:
    from ..export.quantize import FP32_ONLY as NOT_CONVERTED  # why each graph has no reduced-precision file

    unknown = sorted(set(choice) - set(GRAPHS))
    if unknown:
        raise RenderError(f"precision ({source}): unknown graph(s) {', '.join(unknown)}; graphs: {', '.join(GRAPHS)}")
    for graph, p in choice.items():
        _check_allowed(graph, p, flavor)
        if p != "fp32" and (graph in FP32_ONLY or graph in NOT_CONVERTED):
            why = NOT_CONVERTED.get(graph, "float64 phase accumulation")
            raise RenderError(f"precision ({source}): {graph} is served in fp32 only, got {p} ({why})")
    return PrecisionPlan(MappingProxyType({g: choice.get(g, "fp32") for g in GRAPHS}), True, source)


def parse_precision_mapping(text: str) -> dict[str, str]:
    """``"flow_encoder=int8_cpu,flow_estimator=fp32"`` -> a dict (graphs not named: fp32)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        graph, sep, p = (s.strip() for s in part.partition("="))
        if not sep or not graph or not p:
            raise RenderError(f"precision mapping {text!r}: expected GRAPH=PRECISION[,GRAPH=PRECISION...], got "
                              f"{part!r}")
        if graph in out and out[graph] != p:
            raise RenderError(f"precision mapping {text!r}: {graph} given twice")
        out[graph] = p
    if not out:
        raise RenderError(f"precision mapping {text!r} names no graph")
    return out


def read_cpu_choice(report: str | Path) -> dict[str, str]:
    """Graph -> CPU precision from a quality report's ``decisions`` (``export/quality_report.py``, ``make
    quality``: ``build/quality/report.json``)."""
    path = Path(report)
    if not path.is_file():
        raise RenderError(f"precision {CPU_CHOICE}: quality report {path} not found (make quality writes it, or "
                          "give --quality-report PATH, or name the precisions: GRAPH=PRECISION,...)")
    try:
        doc = json.loads(path.read_text())
        decisions = doc["decisions"]
        choice = {str(d["stage"]): str(d["cpu_precision"]) for d in decisions}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RenderError(f"precision {CPU_CHOICE}: {path} is not a quality report with decisions "
                          f"[{{stage, cpu_precision}}, ...] ({type(exc).__name__}: {exc})") from exc
    if not choice:
        raise RenderError(f"precision {CPU_CHOICE}: {path} has no decisions")
    return choice


def precision_plan(precision: str | Mapping[str, str], flavor: str, *,
                   quality_report: str | Path = DEFAULT_QUALITY_REPORT) -> PrecisionPlan:
    """What each graph is asked to be served in. ``precision``: one of :data:`PRECISIONS` for every graph (the
    :data:`FP32_ONLY` graphs stay fp32; a missing file falls back along :data:`ONNX_FALLBACK`); ``cpu-choice``:
    the quality report's CPU decision per graph (flavor ``local``); ``GRAPH=PRECISION,...`` or a mapping: those
    graphs in those precisions, the others fp32. Per-graph choices need their files."""
    if flavor not in FLAVOR_PRECISIONS:
        raise RenderError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    if isinstance(precision, Mapping):
        return _per_graph(dict(precision), flavor, "per graph")
    if precision == CPU_CHOICE:
        if flavor != "local":
            raise RenderError(f"precision {CPU_CHOICE} is the quality report's CPU choice (onnxruntime on the CPU, "
                              f"flavor local); flavor {flavor} runs the graphs on the GPU: give fp16 / int8 or "
                              "GRAPH=PRECISION,...")
        return _per_graph(read_cpu_choice(quality_report), flavor, f"{CPU_CHOICE} of {quality_report}")
    if "=" in precision:
        return _per_graph(parse_precision_mapping(precision), flavor, "per graph")
    if precision not in PRECISIONS:
        raise RenderError(f"precision must be one of {', '.join(PRECISIONS)}, {CPU_CHOICE} or GRAPH=PRECISION,..., "
                          f"got {precision!r}")
    _check_allowed("every graph", precision, flavor)
    return PrecisionPlan(MappingProxyType({g: "fp32" if g in FP32_ONLY else precision for g in GRAPHS}), False,
                         f"{precision} for every graph" + (f"; {', '.join(FP32_ONLY)} fp32 only" if precision != "fp32"
                                                           else ""))


def _check_plan(plan: PrecisionPlan, flavor: str, onnx_dir: Path, tun: Tunables, allow_missing: bool) -> None:
    """A per-graph choice needs its ONNX file (where the flavor reads one); ``runtime=torch`` graphs are fp32."""
    for name, asked in plan.graphs.items():
        torch_run = flavor == "local" and tun.runtime == "torch" and name in TORCH_GRAPHS
        if torch_run and asked != "fp32":
            raise RenderError(f"{name}: runtime=torch runs the checkpoint's fp32 modules; precision "
                              f"{plan.describe(name)} applies to ONNX graphs (runtime=onnxruntime)")
        path = _onnx_file(onnx_dir, name, asked, strict=True)
        needs_file = not torch_run and (flavor != "trt" or name in EXCLUDED)
        if plan.strict and needs_file and not allow_missing and not path.is_file():
            raise RenderError(f"{path} not found: {name} is to be served in {plan.describe(name)} "
                              f"({'make quantize' if asked != 'fp32' else 'make export'} first)")


def _onnx_file(onnx_dir: Path, graph: str, precision: str, *, strict: bool = False) -> Path:
    """``<onnx_dir>/<precision>/<graph>.onnx``; not strict: the first that exists along :data:`ONNX_FALLBACK`
    (else the fp32 path, missing)."""
    if strict:
        return onnx_dir / precision / f"{graph}.onnx"
    for p in ONNX_FALLBACK[precision]:
        path = onnx_dir / p / f"{graph}.onnx"
        if path.is_file():
            return path
    return onnx_dir / "fp32" / f"{graph}.onnx"


_ONNX_ELEM = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 10: "float16"}


def check_onnx_io(path: Path, graph: str) -> None:
    """The file's input / output names and element types must be the spec's (a converted fp16 file must keep
    float32 I/O), or the Triton config rendered from the spec would not load it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    spec = GRAPHS[graph]
    for kind, declared, values in (("input", spec.inputs, model.graph.input), ("output", spec.outputs,
                                                                               model.graph.output)):
        got = {v.name: _ONNX_ELEM.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))
               for v in values}
        for t in declared:
            if got.get(t.name) != t.dtype:
                raise RenderError(f"{path}: {kind} {t.name!r} is {got.get(t.name, 'absent')}, the spec says "
                                  f"{t.dtype} (convert with float32 I/O kept, e.g. keep_io_types=True)")


def _place(src: Path, dst: Path, allow_missing: bool) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not src.is_file():
        if not allow_missing:
            raise RenderError(f"{src} not found (make export / make engines first)")
        dst.write_bytes(b"")  # structural render: an empty placeholder where the file will be
        return dst
    try:
        os.link(src, dst)  # same file system: no copy of a large graph
    except OSError:
        shutil.copy2(src, dst)
    return dst


# ------------------------------------------------------------------------------- served models (table)


@dataclass(frozen=True)
class RenderContext:
    """What a :class:`ServedModel`'s callables may read: the flavor, the tunables, the model folder, and whether
    the TTS models are rendered (``has_tts``)."""

    flavor: str
    tunables: Tunables
    model_dir: Path
    has_tts: bool
    engine_dir: Path = Path("build/engines")


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
            "max_text_chars": tun.max_text_chars, "n_timesteps": tun.n_timesteps,
            "bls_timeout_us": tun.bls_timeout_us, "torch_threads": tun.torch_threads,
            "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds, **_prompt_cache_params(ctx),
            "stage_suffix": TASK_SUFFIX if tun.task_isolation else "", "lm_precision": tun.lm_precision,
            **tun.stream_params()}


def _tts_front_params(ctx: RenderContext) -> dict[str, Any]:
    return {**_output_params(ctx), "stream_model": TTS_STREAM_MODEL, "bls_timeout_us": ctx.tunables.bls_timeout_us,
            "model_sample_rate": _model_sample_rate(ctx.model_dir)}


def _trtllm_values(ctx: RenderContext) -> dict[str, Any]:
    from dataclasses import replace

    from ..errors import CosyVoiceError
    from ..export.trtllm import served_vocabulary

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


def _live_vc_params(ctx: RenderContext) -> dict[str, Any]:
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
    return {"model_dir": str(ctx.model_dir), "n_timesteps": tun.n_timesteps, "default_seed": tun.default_seed,
            "min_seconds": tun.min_seconds, "max_seconds": tun.max_seconds, **_live_sessions(ctx),
            "chunk_tokens": settings.chunk_tokens, "tokenizer_context_tokens": settings.tokenizer_context_tokens,
            "tokenizer_lookahead_tokens": settings.tokenizer_lookahead_tokens,
            "flow_context_tokens": settings.flow_context_tokens, "max_piece_seconds": settings.max_piece_seconds,
            "bls_timeout_us": tun.bls_timeout_us, **_output_params(ctx), **_prompt_cache_params(ctx)}


def _live_tts_params(ctx: RenderContext) -> dict[str, Any]:
    tun = ctx.tunables
    if tun.live_tts_max_sessions < 1 or tun.live_tts_max_queued < 1 or not tun.live_text_timeout_s > 0 \
            or not tun.live_tts_max_token_text_ratio > 0:
        raise RenderError("tunables live_tts_max_sessions and live_tts_max_queued must be >= 1, live_text_timeout_s "
                          "and live_tts_max_token_text_ratio > 0")
    return {**_tts_params(ctx), "max_sessions": tun.live_tts_max_sessions, "max_queued": tun.live_tts_max_queued,
            "text_timeout_s": tun.live_text_timeout_s, "max_token_text_ratio": tun.live_tts_max_token_text_ratio}


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
                    "model_dir": str(ctx.model_dir), "speaker_dir": ctx.tunables.speaker_dir,
                    "capacity": ctx.tunables.speaker_capacity, "min_seconds": ctx.tunables.min_seconds,
                    "max_seconds": ctx.tunables.max_seconds, "bls_timeout_us": ctx.tunables.bls_timeout_us,
                    **_prompt_cache_params(ctx)},
                doc="register / get / list / delete speakers (one instance owns the store); BLS: speech_tokenizer, "
                    "speaker_encoder"),
    ServedModel(VC_STREAM_MODEL, f"ensemble/{VC_STREAM_MODEL}", VC_STREAM_INPUTS, VC_STREAM_OUTPUTS,
                frozenset(t.name for t in VC_STREAM_INPUTS), decoupled=True, parameters=lambda ctx: {
                    "model_dir": str(ctx.model_dir), "n_timesteps": ctx.tunables.n_timesteps,
                    "default_seed": ctx.tunables.default_seed, "min_seconds": ctx.tunables.min_seconds,
                    "max_seconds": ctx.tunables.max_seconds, "bls_timeout_us": ctx.tunables.bls_timeout_us,
                    "max_streams": ctx.tunables.vc_max_streams, "max_waiting": ctx.tunables.vc_max_waiting,
                    **ctx.tunables.stream_params(), **_output_params(ctx), **_prompt_cache_params(ctx)},
                doc="streaming voice conversion (decoupled BLS orchestrator): one response per chunk on the official "
                    "schedule; chunked flow_encoder / flow_estimator / hift graphs"),
    ServedModel(LIVE_VC_MODEL, f"ensemble/{LIVE_VC_MODEL}", LIVE_VC_INPUTS, LIVE_VC_OUTPUTS,
                frozenset(t.name for t in LIVE_VC_INPUTS), template=f"ensemble/{LIVE_VC_MODEL}/config.pbtxt.in",
                decoupled=True, parameters=lambda ctx: _live_vc_params(ctx), values=lambda ctx: _live_values(ctx),
                doc="live voice conversion (decoupled BLS orchestrator, sequence batcher): one request per piece of "
                    "source audio as it is recorded, converted chunks as soon as they can be computed"),
    ServedModel(TTS_STREAM_MODEL, f"ensemble/{TTS_STREAM_MODEL}",
                (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS, *TTS_STREAM_EXTRA_INPUTS), TTS_STREAM_OUTPUTS,
                frozenset(t.name for t in (*TTS_OPTIONAL_INPUTS, *TTS_STREAM_EXTRA_INPUTS)), max_batch_size=8,
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
    ServedModel(TTS_MODEL, f"ensemble/{TTS_MODEL}", (*TTS_INPUTS, *TTS_OPTIONAL_INPUTS), TTS_OUTPUTS,
                frozenset(t.name for t in TTS_OPTIONAL_INPUTS), max_batch_size=8, parameters=_tts_front_params,
                when=_tts, doc=f"non-streaming TTS: each request of a batch sent on to {TTS_STREAM_MODEL} "
                               "(stream=false: one answer per text segment) by BLS, the segments concatenated"),
    ServedModel("tensorrt_llm", "model_repository/tensorrt_llm", TRTLLM_INPUTS, TRTLLM_OUTPUTS,
                frozenset(t.name for t in TRTLLM_INPUTS[2:]), kind="backend", values=_trtllm_values,
                when=lambda ctx: ctx.tunables.lm_backend == "tensorrtllm",
                doc="tensorrtllm: the LM as a TensorRT-LLM engine (in-flight batching, paged KV cache, streaming)"),
    ServedModel(OFFICIAL_MODEL, f"ensemble/{OFFICIAL_MODEL}", OFFICIAL_INPUTS, OFFICIAL_OUTPUTS, OFFICIAL_OPTIONAL,
                max_batch_size=8, decoupled=lambda ctx: ctx.tunables.cosyvoice2_decoupled, when=_official,
                parameters=lambda ctx: {"offline_model": TTS_MODEL, "stream_model": TTS_STREAM_MODEL,
                                        "bls_timeout_us": ctx.tunables.bls_timeout_us},
                doc="the official CosyVoice runtime's interface (reference_wav, reference_wav_len, reference_text, "
                    f"target_text -> waveform at 24 kHz; BLS orchestrator): {TTS_STREAM_MODEL} when decoupled "
                    f"(tunable cosyvoice2_decoupled), else {TTS_MODEL}"),
)
SERVED_NAMES = tuple(m.name for m in SERVED_MODELS)


def _has_tts(model_dir: Path, tun: Tunables) -> bool:
    """Render the TTS models? ``tts=on`` always, ``off`` never, ``auto``: when the folder has the LM files (a
    voice-conversion-only folder still serves VC)."""
    if tun.tts != "auto":
        return tun.tts == "on"
    from ..pipeline import TTS_FILES

    return all((model_dir / f).is_file() for f in TTS_FILES)


def _clean(out: Path) -> None:
    if out.exists():
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise RenderError(f"{out} exists and was not rendered by cosyvoice_triton ({MARKER} missing): "
                              "refusing to delete it")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def render_repository(flavor: str, out_dir: str | Path, *, model_dir: str | Path,
                      onnx_dir: str | Path = "build/onnx", engine_dir: str | Path = "build/engines",
                      precision: str | Mapping[str, str] = "fp32", templates_dir: str | Path | None = None,
                      allow_missing: bool = False, profile: str = "",
                      quality_report: str | Path = DEFAULT_QUALITY_REPORT, ensemble_dir: str | Path | None = None,
                      versions: Sequence[VersionSpec] = (), live_version: int = 0,
                      **tunables: Any) -> RenderReport:
    """Render the repository of ``flavor`` into ``out_dir`` (deleted and rewritten).

    Args:
        flavor: ``local``, ``onnx`` or ``trt`` (see the module docstring).
        model_dir: the CosyVoice2 folder (the stages read its ``cosyvoice2.yaml``).
        onnx_dir: the export's root (``<onnx_dir>/<precision>/<graph>.onnx``, falling back like the engines).
        engine_dir: TensorRT plans (``<engine_dir>/<precision>/<graph>.plan``), flavor ``trt``.
        precision: ``fp32``, ``fp16``, ``int8`` or (flavor ``local``) ``int8_cpu`` for every graph (the
            :data:`FP32_ONLY` graphs stay fp32; a missing file falls back along :data:`ONNX_FALLBACK`);
            ``cpu-choice``: the CPU precision per graph of ``quality_report``'s decisions (flavor ``local``);
            ``"GRAPH=PRECISION,..."`` or a mapping: those graphs in those precisions, the others fp32. A
            per-graph choice needs its file. The configs' notes and the marker record what each graph got.
        quality_report: the quality report JSON that ``cpu-choice`` reads (``make quality``).
        templates_dir: the ``model_repository/`` source (default: this source tree's); the pipelines are read from
            ``ensemble/`` beside it (``ensemble_dir``, if given, must be that folder).
        allow_missing: write empty placeholders for missing ONNX / plan files (structural checks only).
        profile: a name of :data:`PROFILES` (``plain``: :data:`PLAIN_TUNABLES`, flavor ``local`` and precision
            ``fp32`` only); ``tunables`` may add to it but not contradict it.
        versions: numbered versions (:class:`~.rollout.VersionSpec`: model folder, export, precision) of the
            graphs and ``flow`` / ``hift``, each with its pipeline ``cosyvoice_vc_v<N>`` and manifest, and the router
            as ``cosyvoice_vc`` (:mod:`.rollout`); ``model_dir`` / ``onnx_dir`` / ``precision`` are then the live
            version's (``live_version``, default the lowest), and the streaming VC, speakers and TTS models are
            not rendered (they would call the graphs' latest version).
        tunables: fields of :class:`Tunables`.
    """
    if flavor not in FLAVORS:
        raise RenderError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    versions, live_spec = _check_versions(versions, live_version, tunables)
    if live_spec is not None:
        model_dir, onnx_dir, precision = live_spec.model_dir, live_spec.onnx_dir, live_spec.precision
    plan = precision_plan(precision, flavor, quality_report=quality_report)
    known = {f.name for f in fields(Tunables)}
    unknown = sorted(set(tunables) - known)
    if unknown:
        raise RenderError(f"unknown tunable(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if profile:
        tunables = _apply_profile(profile, flavor, plan, tunables)
    tun = Tunables(**tunables)
    if tun.lm_backend == "tensorrtllm" and flavor == "local":
        raise RenderError("lm_backend=tensorrtllm needs a GPU flavor (onnx or trt): the TensorRT-LLM backend runs "
                          "on NVIDIA GPUs only")
    templates = Path(templates_dir) if templates_dir else default_templates_dir()
    root = templates.parent  # model_repository/ and ensemble/ side by side
    if ensemble_dir is not None and Path(ensemble_dir).resolve() != (root / "ensemble").resolve():
        raise RenderError(f"ensemble_dir {ensemble_dir} must be {root / 'ensemble'}: the pipelines' folder lies "
                          "beside model_repository/")
    model_dir = Path(model_dir).resolve()
    onnx_dir, engine_dir = Path(onnx_dir).resolve(), Path(engine_dir).resolve()
    if not (model_dir / "cosyvoice2.yaml").is_file() and not allow_missing:
        raise RenderError(f"{model_dir}/cosyvoice2.yaml not found: model_dir must be a CosyVoice2 folder")
    _check_plan(plan, flavor, onnx_dir, tun, allow_missing)  # before anything is deleted or written
    if precision == CPU_CHOICE:
        _warn_foreign_report(quality_report, model_dir, onnx_dir)
    out = Path(out_dir)
    _clean(out)
    files: list[Path] = []
    models: dict[str, str] = {}
    note = ("generated by cosyvoice_triton.serving.repository from {src} (flavor " + flavor
            + (f", profile {profile}" if profile else "") + "): do not edit, edit the template and render again")

    def common(name: str) -> dict[str, Any]:
        original = name.removesuffix(TASK_SUFFIX) if name in TASK_COPIES else name  # a copy: as many by default
        default = next((m.instances for m in SERVED_MODELS if m.name == original), 1)
        default = tun.instances.get(original, default)
        return {"dynamic_batching": _dynamic_batching_block(tun, name),
                "instance_count": _instance_count(tun, name, int(tun.instances.get(name, default)))}

    def source(rel: str) -> Path:  # a path of the table (model_repository/... or ensemble/...) in this render
        head, _, rest = rel.partition("/")
        return templates / rest if head == "model_repository" else root / rel

    def write(name: str, template: str, values: Mapping[str, Any], src: Path | None = None) -> None:
        src = src or source(template)
        if not src.is_file():
            raise RenderError(f"template {src} not found")
        text = render_template(src.read_text(), {"generated_note": note.format(src=template), **values},
                               source=str(src))
        path = out / name / "config.pbtxt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n")
        files.append(path)

    def python_code(name: str, src_dir: Path) -> None:
        src = src_dir / "model.py"
        if not src.is_file():
            raise RenderError(f"{src} not found")
        dst = out / name / "1" / "model.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        files.append(dst)

    has_tts = _has_tts(model_dir, tun)
    isolate = tun.task_isolation
    if isolate and (versions or not has_tts):
        raise RenderError("task_isolation copies the stages TTS shares with VC: it needs the TTS models (tts=on or a "
                          "folder with llm.pt) and no versions (a versioned render has no TTS models)")

    def copy_for_tts(name: str, template: str, values: Mapping[str, Any], params: Mapping[str, Any],
                     src: Path | None = None) -> None:
        """The TTS task's copy of model ``name`` (``task_isolation``): its folder, config renamed, ``params`` with
        the copy's own ``nice``."""
        copy = f"{name}{TASK_SUFFIX}"
        shutil.copytree(out / name, out / copy)
        files.extend(p for p in (out / copy).rglob("*") if p.is_file() and p.name != "config.pbtxt")
        own = {k: v for k, v in params.items() if k != "nice"} | (_nice(tun, copy) if params else {})
        write(copy, template, {**values, **common(copy), "name": copy, "parameters": _parameters_block(own)}, src)
        models[copy] = f"{models[name]}, the TTS task's copy (task_isolation)"

    # --- the six graphs
    graph_precisions: dict[str, str] = {}
    served_graphs: dict[int, dict[str, tuple[Path, str]]] = {v.number: {} for v in versions}
    for name, spec in GRAPHS.items():
        asked = plan.graphs[name]
        onnx_path = _onnx_file(onnx_dir, name, asked, strict=plan.strict)
        served = onnx_path.parent.name if onnx_path.is_file() else asked
        if onnx_path.is_file() and not (flavor == "trt" and name not in EXCLUDED):
            check_onnx_io(onnx_path, name)
        params: dict[str, Any] = {}
        ragged = False
        if flavor == "local":
            backend, kind, ragged = 'backend: "python"', "KIND_CPU", True
            runtime = tun.runtime if name in TORCH_GRAPHS else "onnxruntime"
            if runtime == "onnxruntime" and not onnx_path.is_file() and not allow_missing:
                raise RenderError(f"{onnx_path} not found (make export first)")
            if runtime == "torch":
                served = "fp32 (torch)"
            params = {"graph": name, "runtime": runtime, "onnx_path": str(onnx_path) if runtime == "onnxruntime"
                      else "", "model_dir": str(model_dir) if runtime == "torch" else "", "device": tun.device,
                      "intra_op_threads": tun.intra_op_threads, "torch_threads": tun.torch_threads,
                      **({"graph_cache_mb": tun.graph_cache_mb} if name in RESPONSE_CACHE_GRAPHS else {}),
                      **_nice(tun, name)}
            if versions:
                params["onnx_path"] = "model.onnx"  # in each version's folder
            python_code(name, templates / "graph")
            runtime_note = (f"Python backend, {runtime} on {tun.device}, precision {served}"
                            + (f" of {onnx_path}" if runtime == "onnxruntime" else "")
                            + f" (asked: {plan.describe(name)}) (model_repository/graph/model.py)")
            models[name] = f"python ({runtime}, {served})"
        elif flavor == "trt" and name not in EXCLUDED:
            backend = 'platform: "tensorrt_plan"\ndefault_model_filename: "model.plan"'
            kind = tun.instance_kind or "KIND_GPU"
            served = asked
            files.append(_place(engine_dir / asked / f"{name}.plan", out / name / "1" / "model.plan",
                                allow_missing))
            runtime_note = f"TensorRT engine {engine_dir / asked / (name + '.plan')} (precision {plan.describe(name)})"
            models[name] = f"tensorrt_plan ({served})"
        else:
            backend = 'backend: "onnxruntime"\ndefault_model_filename: "model.onnx"'
            kind = tun.instance_kind or "KIND_GPU"
            files.append(_place(onnx_path, out / name / "1" / "model.onnx", allow_missing))
            why = f" ({EXCLUDED[name].reason})" if flavor == "trt" else ""
            runtime_note = f"onnxruntime backend, precision {served} of {onnx_path} (asked: {plan.describe(name)}){why}"
            models[name] = f"onnxruntime ({served})"
        graph_precisions[name] = served
        warmup = ""
        if tun.warmup:
            samples, batch = graph_warmup_samples(name)
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, batch)
        values = {
            **common(name), "name": name, "graph": name, "graph_doc": spec.doc, "flavor": flavor,
            "runtime_note": runtime_note, "backend": backend, "max_batch_size": spec.max_batch_size,
            "inputs": _io_block("input", spec.inputs, ragged=ragged), "outputs": _io_block("output", spec.outputs),
            "instance_kind": kind, "parameters": _parameters_block(params), "warmup": warmup,
            "response_cache": _response_cache_block(tun, name)}
        template = templates / "graph" / "config.pbtxt.in"
        write(name, "model_repository/graph/config.pbtxt.in", values, template)
        if isolate:
            copy_for_tts(name, "model_repository/graph/config.pbtxt.in", values, params, template)
        if versions:
            files += _graph_versions(out / name, name, flavor, versions, engine_dir, quality_report, tun,
                                     allow_missing, served_graphs)

    # --- the served models of SERVED_MODELS: the stages (model_repository/) and the pipelines (ensemble/)
    ctx = RenderContext(flavor=flavor, tunables=tun, model_dir=model_dir, has_tts=has_tts, engine_dir=engine_dir)
    for entry in SERVED_MODELS:
        if not entry.enabled(ctx) or (versions and entry.name in NOT_VERSIONED):
            continue
        name = entry.name
        if versions and name == VC_MODEL:
            files += _version_pipelines(out, entry, versions, live_spec.number, served_graphs, flavor, note,
                                        write, source, ctx)
            models[name] = "python (router: " + ", ".join(_pipeline_model(v.number) for v in versions) + ")"
            models.update({_pipeline_model(v.number): "ensemble" for v in versions})
            continue
        src_dir = source(entry.folder)
        if entry.kind in ("ensemble", "backend"):
            outputs = list(entry.outputs) + ([AUDIO_BYTES] if tun.output_format and name == VC_MODEL else [])
            write(name, f"{entry.folder}/config.pbtxt.in", {
                "name": name, "inputs": _io_block("input", entry.inputs, optional=entry.optional),
                "outputs": _io_block("output", outputs), **(entry.values(ctx) if entry.values else {})},
                  src_dir / "config.pbtxt.in")
            (out / name / "1").mkdir(parents=True, exist_ok=True)  # a version folder (empty: the config says all)
            models[name] = entry.kind if entry.kind == "ensemble" else entry.doc.split(":")[0]
            continue
        params = dict(entry.parameters(ctx)) if entry.parameters else {}
        if name in NICE_MODELS:
            params.update(_nice(tun, name))
        if versions and name in VERSIONED:
            params["pin_graph_version"] = True
        declared = {p.name for p in MODEL_PARAMS.get(entry.params_key or name, ())}
        if not set(params) <= declared:
            raise RenderError(f"{name}: parameters {sorted(set(params) - declared)} are not declared in "
                              f"MODEL_PARAMS[{entry.params_key or name!r}]")
        outputs = list(entry.outputs) + ([AUDIO_BYTES] if name == "postprocess" and tun.output_format else [])
        warmup = ""
        samples = entry.warmup(ctx) if tun.warmup and entry.warmup else None
        if samples is not None:
            files += _write_warmup(out / name, samples)
            warmup = _warmup_block(samples, 1)
        values = {
            **common(name), "name": name, "stage_doc": f"{name}: {entry.doc}", "source": entry.folder,
            "max_batch_size": entry.max_batch_size,
            "inputs": _io_block("input", entry.inputs, ragged=True, optional=entry.optional),
            "outputs": _io_block("output", outputs), "parameters": _parameters_block(params),
            "model_transaction_policy": ("model_transaction_policy { decoupled: true }" if entry.is_decoupled(ctx)
                                         else ""),
            "warmup": warmup, **(entry.values(ctx) if entry.values else {})}
        write(name, entry.template, values)
        python_code(name, src_dir)
        if versions and name in VERSIONED:
            files += _stage_versions(out / name, versions)
        models[name] = "python" + (" (decoupled)" if entry.is_decoupled(ctx) else "")
        if isolate and name in ISOLATED_STAGES:  # its callees: the TTS copies of the graphs
            callees = {k: f"{v}{TASK_SUFFIX}" for k, v in params.items() if k.endswith("_model")}
            copy_for_tts(name, entry.template, {
                **values, "stage_doc": f"{name}{TASK_SUFFIX}: the TTS task's copy of {name} (task_isolation): "
                                       f"{entry.doc}"}, {**params, **callees})

    marker = {"flavor": flavor, "profile": profile,
              "precision": dict(precision) if isinstance(precision, Mapping) else precision,
              "precision_source": plan.source, "graph_precisions": graph_precisions, "model_dir": str(model_dir),
              "onnx_dir": str(onnx_dir), "engine_dir": str(engine_dir), "templates": str(templates.resolve()),
              "models": models,
              "versions": {str(v.number): _pipeline_model(v.number) for v in versions},
              "live_version": live_spec.number if live_spec is not None else 0,
              "tunables": {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(tun).items()}}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log.info("rendered %s (%s, %d models)", out, flavor, len(models))
    return RenderReport(flavor, out, models, files, profile)


def parse_tunable(text: str) -> tuple[str, Any]:
    """``"NAME=VALUE"`` -> (name, typed value) for a field of :class:`Tunables` (``instances=flow:2,hift:2``,
    ``warmup=false``, ``max_queue_delay_us=5000``); :class:`RenderError` names the known fields otherwise."""
    name, sep, value = text.partition("=")
    types = {f.name: str(f.type) for f in fields(Tunables)}
    if not sep or name not in types:
        raise RenderError(f"tunable {text!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(types))}")
    kind = types[name]
    try:
        if "Mapping" in kind:
            return name, {k: int(v) for k, v in (p.split(":") for p in value.split(",") if p)}
        if kind == "bool":
            return name, value.lower() in ("1", "true", "yes", "on")
        if kind in ("int", "float"):
            return name, json.loads(value)
    except ValueError as exc:
        raise RenderError(f"tunable {text!r}: not a valid {kind} ({exc})") from exc
    return name, value


def _warn_foreign_report(report: str | Path, model_dir: Path, onnx_dir: Path) -> None:
    """Log a warning when the quality report behind ``cpu-choice`` judged another model or other graphs."""
    try:
        doc = json.loads(Path(report).read_text())
    except (OSError, ValueError):
        return
    for key, ours in (("model_dir", model_dir), ("onnx_root", onnx_dir)):
        theirs = doc.get(key)
        if theirs and Path(theirs).resolve() != ours:
            log.warning("precision %s: %s was measured with %s %s, this render uses %s: its decisions may not hold "
                        "for these graphs (make quality MODEL_DIR=... to measure them)", CPU_CHOICE, report, key,
                        theirs, ours)


def _apply_profile(profile: str, flavor: str, plan: PrecisionPlan, tunables: Mapping[str, Any]) -> dict[str, Any]:
    """``tunables`` on top of the named profile; refuses a flavor, precision or tunable that contradicts it."""
    if profile not in PROFILES:
        raise RenderError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    not_fp32 = {g: p for g, p in plan.graphs.items() if p != "fp32"}
    if profile == "plain" and (flavor != "local" or not_fp32):
        raise RenderError(f"profile plain is the PyTorch fp32 deployment: flavor local and precision fp32 only, "
                          f"got flavor {flavor}" + (f", precision {plan.source}" if not_fp32 else ""))
    clash = sorted(k for k, v in PROFILES[profile].items() if k in tunables and tunables[k] != v)
    if clash:
        raise RenderError(f"profile {profile} sets {', '.join(f'{k}={PROFILES[profile][k]!r}' for k in clash)}; "
                          f"got {', '.join(f'{k}={tunables[k]!r}' for k in clash)}")
    return {**PROFILES[profile], **tunables}


def _model_sample_rate(model_dir: Path) -> int:
    from ..config import ModelConfig

    path = model_dir / "cosyvoice2.yaml"
    return ModelConfig.from_yaml(path).sample_rate if path.is_file() else 24000


# ------------------------------------------------------------------------------------------- versions
#: Models left out of a versioned render: they call the graphs without a version (by BLS, or as ensemble steps of
#: ``model_version: -1``), so they would reach the newest loaded version (a staged candidate) whatever the router's
#: split says.
NOT_VERSIONED = (VC_STREAM_MODEL, LIVE_VC_MODEL, "speakers", TTS_STREAM_MODEL, TTS_MODEL, "tensorrt_llm",
                 SPEECH_TOKENS_MODEL, SPEAKER_EMBEDDING_MODEL, OFFICIAL_MODEL)


def _check_versions(versions: Sequence[VersionSpec], live: int, tunables: Mapping[str, Any]
                    ) -> tuple[tuple[VersionSpec, ...], VersionSpec | None]:
    versions = tuple(sorted(versions, key=lambda v: v.number))
    if not versions:
        if live:
            raise RenderError("live_version without versions")
        return versions, None
    numbers = [v.number for v in versions]
    if len(set(numbers)) != len(numbers):
        raise RenderError(f"versions: a number given twice ({numbers})")
    if tunables.get("runtime", "onnxruntime") != "onnxruntime":
        raise RenderError("versions: a version is an export; runtime=torch runs the checkpoint's modules instead")
    live = live or numbers[0]
    if live not in numbers:
        raise RenderError(f"live_version {live} is not one of the versions {numbers}")
    return versions, next(v for v in versions if v.number == live)


def _version_policy(path: Path, numbers: Iterable[int]) -> None:
    """Append the ``version_policy`` that loads ``numbers`` to a rendered config."""
    listed = ", ".join(str(n) for n in sorted(numbers))
    with open(path, "a") as f:
        f.write("# the versions served: `rollout stage` / `promote` / `rollback` rewrite this line and load the model\n"
                f"version_policy {{ specific {{ versions: [ {listed} ] }} }}\n")


def _graph_versions(model: Path, name: str, flavor: str, versions: Sequence[VersionSpec], engine_dir: Path,
                    quality_report: str | Path, tun: Tunables, allow_missing: bool,
                    served: dict[int, dict[str, tuple[Path, str]]]) -> list[Path]:
    """One folder per version with that version's file of graph ``name`` (replacing the single ``1/``)."""
    code = model / "1" / "model.py"
    code_text = code.read_bytes() if code.is_file() else None
    shutil.rmtree(model / "1")
    files: list[Path] = []
    for v in versions:
        plan = precision_plan(v.precision, flavor, quality_report=quality_report)
        onnx_dir = Path(v.onnx_dir).resolve()
        _check_plan(plan, flavor, onnx_dir, tun, allow_missing)
        asked = plan.graphs[name]
        folder = model / str(v.number)
        if flavor == "trt" and name not in EXCLUDED:
            src, dst, precision = Path(engine_dir) / asked / f"{name}.plan", folder / "model.plan", asked
        else:
            src = _onnx_file(onnx_dir, name, asked, strict=plan.strict)
            if not src.is_file() and not allow_missing:
                raise RenderError(f"version {v.number}: {src} not found (make export first)")
            if src.is_file():
                check_onnx_io(src, name)
            dst, precision = folder / "model.onnx", src.parent.name if src.is_file() else asked
            fp32 = onnx_dir / "fp32" / f"{name}.onnx"
            if flavor == "local" and precision != "fp32" and fp32.is_file():  # graphs.py's fallback, by version
                files.append(_place(fp32, folder / "fallback.onnx", allow_missing))
        files.append(_place(src, dst, allow_missing))
        if code_text is not None:
            (folder / "model.py").write_bytes(code_text)
            files.append(folder / "model.py")
        served[v.number][name] = (src, precision)
    return files


def _stage_versions(model: Path, versions: Sequence[VersionSpec]) -> list[Path]:
    """A BLS stage's code in every version's folder (version N calls the graphs' version N)."""
    code = (model / "1" / "model.py").read_bytes()
    files = []
    for v in versions:
        dst = model / str(v.number) / "model.py"
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(code)
        files.append(dst)
    if 1 not in [v.number for v in versions]:
        shutil.rmtree(model / "1")
    return files


def _version_pipelines(out: Path, entry: ServedModel, versions: Sequence[VersionSpec], live: int,
                       served: Mapping[int, Mapping[str, tuple[Path, str]]], flavor: str, note: str,
                       write: Callable[..., None], source: Callable[[str], Path], ctx: RenderContext) -> list[Path]:
    """Per version its pipeline (the ensemble, graph and BLS steps pinned to the version) and manifest; the router
    under the public name with the live version at 100%; the live version's ``version_policy`` everywhere."""
    files: list[Path] = []
    outputs = list(entry.outputs) + ([AUDIO_BYTES] if ctx.tunables.output_format else [])
    values = {"inputs": _io_block("input", entry.inputs, optional=entry.optional),
              "outputs": _io_block("output", outputs), **(entry.values(ctx) if entry.values else {})}
    step = re.compile(r'(model_name: "(' + "|".join(VERSIONED) + r')"\s*\n\s*model_version: )-1')
    for v in versions:
        name = _pipeline_model(v.number)
        write(name, f"{entry.folder}/config.pbtxt.in", {"name": name, **values}, source(entry.folder) /
              "config.pbtxt.in")
        path = out / name / "config.pbtxt"
        text, pinned = step.subn(lambda m, n=v.number: m.group(1) + str(n), path.read_text())
        if pinned < 4:
            raise RenderError(f"{path}: the graph and BLS steps should pin version {v.number}; pinned {pinned}")
        path.write_text(text)
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        manifest = version_manifest(v, {g: p for g, (p, _) in served[v.number].items()},
                                    {g: prec for g, (_, prec) in served[v.number].items()}, flavor=flavor)
        (out / name / VERSION_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        files += [path, out / name / VERSION_MANIFEST]
    router = source("ensemble/cosyvoice_vc_router")
    params = {p.name: p.default for p in ROUTER_PARAMS}
    params.update(split=f"{live}:100", live_version=live, candidate_version=0,
                  bls_timeout_us=ctx.tunables.bls_timeout_us)
    write(entry.name, "ensemble/cosyvoice_vc_router/config.pbtxt.in", {
        "name": entry.name, "max_batch_size": 1,
        "inputs": _io_block("input", entry.inputs, ragged=True, optional=entry.optional),
        "outputs": _io_block("output", outputs),
        "instance_count": int(ctx.tunables.instances.get(entry.name, 4)),  # requests forwarded at once
        "parameters": _parameters_block(params)}, router / "config.pbtxt.in")
    dst = out / entry.name / "1" / "model.py"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(router / "model.py", dst)
    files += [out / entry.name / "config.pbtxt", dst]
    for model in VERSIONED:
        _version_policy(out / model / "config.pbtxt", [live])
    return files
