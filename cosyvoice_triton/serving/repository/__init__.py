"""Render the Triton model repository (``build/model_repository``) from ``model_repository/`` and ``ensemble/``.

Two source folders, one served repository: ``model_repository/`` holds the stage models (a template per kind:
``graph/config.pbtxt.in`` for the six exported graphs, ``stage/config.pbtxt.in`` for every Python model, and
the thin ``model.py`` adapters); ``ensemble/`` holds the pipelines, one folder each (``cosyvoice_vc``: an
ensemble's ``config.pbtxt.in``; BLS orchestrators: a ``model.py``). Everything else is derived in this package: tensor
names, dtypes, dims and max batch sizes from :data:`~cosyvoice_triton.shapes.GRAPHS` and the table
:data:`SERVED_MODELS` (one row per non-graph model: folder, template, tensors, decoupled flag, instances,
parameters), config ``parameters`` declared in :data:`~cosyvoice_triton.serving.stages.model_params.MODEL_PARAMS`.

Templates use ``${name}`` placeholders and are strict: a placeholder without a value, a value without a
placeholder, or a ``$`` that is not a well-formed placeholder is an error (:class:`RenderError`). The output
folder is rendered anew each time (a folder that this package did not write is never deleted).

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
Modules:

* :mod:`.templates`: :func:`render_template`, :class:`RenderError`, the config text blocks, graph warm-up samples.
* :mod:`.tunables`: :class:`Tunables`, :func:`parse_tunable`, ``--set`` (:class:`TunableAction`), the profiles, the
  config lines of the task tunables.
* :mod:`.precisions`: :class:`PrecisionPlan`, :func:`precision_plan`, ``cpu-choice``, the ONNX files' checks.
* :mod:`.versions`: numbered versions (``versions=``): their folders, pipelines, manifests and the router.
* :mod:`.served`: the served-model table (:data:`SERVED_MODELS`, :class:`ServedModel`, :class:`RenderContext`).
* :mod:`.render`: :func:`render_repository`, the entry.

The marker a render writes (:data:`MARKER`, what was rendered) is :mod:`cosyvoice_triton.serving.marker`, read by
the launchers and the load tests without this package's imports.
"""

from ..marker import MARKER, read_marker
from .precisions import (
    CPU_CHOICE,
    DEFAULT_QUALITY_REPORT,
    FLAVOR_PRECISIONS,
    FLAVORS,
    FP32_ONLY,
    ONNX_FALLBACK,
    PRECISIONS,
    TORCH_GRAPHS,
    PrecisionPlan,
    check_onnx_io,
    parse_precision_mapping,
    precision_plan,
    read_cpu_choice,
)
from .render import RenderReport, render_repository
from .served import (
    ISOLATED_STAGES,
    LEAF_MODELS,
    RESPONSE_CACHE_GRAPHS,
    SERVED_MODELS,
    SERVED_NAMES,
    TASK_COPIES,
    TASK_SUFFIX,
    RenderContext,
    ServedModel,
)
from .templates import RenderError, default_templates_dir, graph_warmup_samples, render_template
from .tunables import (
    PLAIN_TUNABLES,
    PROFILES,
    SET_HELP,
    TunableAction,
    Tunables,
    parse_tunable,
    parse_tunables,
    split_tunables,
)
from .versions import NOT_VERSIONED

__all__ = ["CPU_CHOICE", "DEFAULT_QUALITY_REPORT", "FLAVORS", "FLAVOR_PRECISIONS", "FP32_ONLY", "ISOLATED_STAGES",
           "LEAF_MODELS", "MARKER", "NOT_VERSIONED", "ONNX_FALLBACK", "PLAIN_TUNABLES", "PRECISIONS", "PROFILES",
           "RESPONSE_CACHE_GRAPHS", "SERVED_MODELS", "SERVED_NAMES", "SET_HELP", "TASK_COPIES", "TASK_SUFFIX",
           "TORCH_GRAPHS", "PrecisionPlan", "RenderContext", "RenderError", "RenderReport", "ServedModel",
           "TunableAction", "Tunables", "check_onnx_io", "default_templates_dir", "graph_warmup_samples",
           "parse_precision_mapping", "parse_tunable", "parse_tunables", "precision_plan", "read_cpu_choice",
           "read_marker", "render_repository", "render_template", "split_tunables"]
