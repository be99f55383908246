"""TensorRT engine builds of the exported graphs, derived from the shape spec.

Everything that can be computed without TensorRT lives here and is tested anywhere: the ``trtexec`` command
line of each graph and precision (optimisation profile from :meth:`GraphSpec.profile`, one shared timing
cache, detailed profiling verbosity, the per-layer report), which graphs stay off TensorRT and why, and a
reader of the per-layer report that counts layers per precision. The builds themselves need a GPU and
TensorRT, which exist only inside the NGC Triton container (``Dockerfile.triton``).

Layout::

    build/onnx/{fp32,fp16,int8}/<graph>.onnx      # export (fp32), fp16 conversion, INT8 Q/DQ quantisation
    build/engines/<precision>/<graph>.plan        # serialized engine
    build/engines/<precision>/<graph>.layers.json # trtexec --exportLayerInfo: layers and their tensor types
    build/engines/<precision>/<graph>.build.log   # trtexec --verbose output
    build/engines/timing.cache                    # one timing cache shared by every build

Typing (TensorRT 10 deprecates weak typing, TensorRT 11 removes ``--fp16``/``--int8``): every build is
**strongly typed** (``--stronglyTyped``), so each layer runs in the type the ONNX file gives it. INT8 is
explicit quantisation, Q/DQ nodes in ``build/onnx/int8`` (no ``--int8``, no calibrator); fp16 is an ONNX
file converted to fp16 (``build/onnx/fp16``). A graph that has no file of the requested precision is built
from its fp32 file, and the build says so. ``BuildOptions(weak_fp16=True)`` (``--weak-fp16`` on the command
line) is the one opt-in exception: for ``--precision fp16`` it builds an fp32 file with ``--fp16`` and lets
the builder choose fp16 per layer; it is deprecated in TensorRT 10 and gone in 11.

Profiles: min/opt/max come from :meth:`GraphSpec.profile`, except that an axis the ONNX file fixes (a
shipped graph whose batch axis the export left at 1) is pinned to the file's size, with a note; an ONNX file
whose inputs contradict the spec is an error.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..shapes import GRAPHS, GraphSpec

PRECISIONS = ("fp32", "fp16", "int8")
BUILDERS = ("trtexec", "python")

#: ONNX precisions tried for each requested precision, in order.
ONNX_FALLBACK: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "fp32": ("fp32",),
    "fp16": ("fp16", "fp32"),
    "int8": ("int8", "fp16", "fp32"),  # a graph left unquantised still runs in fp16 when an fp16 file exists
})

#: Where trtexec lives in the NGC TensorRT / Triton containers.
TRTEXEC_NGC_PATH = "/usr/src/tensorrt/bin/trtexec"
TRTEXEC_NOT_FOUND = "trtexec not found: engine builds run inside the NGC Triton container (Dockerfile.triton)"
TENSORRT_NOT_INSTALLED = "TensorRT is not installed here; engines are built in the NGC container (Dockerfile.triton)"
TIMING_CACHE_NAME = "timing.cache"


class EngineBuildError(RuntimeError):
    """A build that cannot run here (no trtexec, no TensorRT, no ONNX file) or that TensorRT refused."""


@dataclass(frozen=True)
class Exclusion:
    reason: str
    #: True: built anyway when named explicitly in ``graphs``. False: never built (TensorRT cannot run it).
    overridable: bool


#: Graphs that run on onnxruntime instead of TensorRT, with the reason.
EXCLUDED: Mapping[str, Exclusion] = MappingProxyType({
    "hift_source": Exclusion(
        "float64 phase accumulation (Cast/CumSum on doubles, needed for parity): TensorRT has no float64; "
        "runs on onnxruntime", overridable=False),
    "speech_tokenizer": Exclusion(
        "speech_tokenizer_v2.onnx as shipped has not been checked against the TensorRT ONNX parser; runs on "
        "onnxruntime unless named in --graphs", overridable=True),
})


@dataclass(frozen=True)
class BuildOptions:
    opt_level: int = 3  # --builderOptimizationLevel, 0..5
    workspace_mib: int = 8192  # --memPoolSize=workspace:<MiB>
    verbose: bool = True  # --verbose into <graph>.build.log
    iterations: int = 0  # 0: --skipInference; N > 0: N timed inference iterations at the opt shapes
    weak_fp16: bool = False  # fp16 without an fp16 ONNX file: fp32 file + --fp16 (deprecated weak typing)

    def __post_init__(self):
        if not 0 <= self.opt_level <= 5:
            raise ValueError(f"builder optimization level must be 0..5, got {self.opt_level}")
        if self.workspace_mib < 1:
            raise ValueError(f"workspace must be at least 1 MiB, got {self.workspace_mib}")
        if self.iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {self.iterations}")


@dataclass(frozen=True)
class BuildPlan:
    """One engine build: where its files are and how it is typed."""

    graph: str
    graph_spec: GraphSpec  # GRAPHS[graph]: the profile's source
    precision: str  # requested: the engine folder
    onnx_precision: str  # the ONNX file actually used
    onnx_path: Path
    engine_path: Path
    layers_path: Path
    log_path: Path
    timing_cache: Path
    strongly_typed: bool
    weak_fp16: bool
    no_tf32: bool
    note: str = ""  # fallback / missing-file / fixed-axis messages, empty when nothing is unusual
    onnx_exists: bool = True
    #: input -> (min, opt, max): the spec's profile, with the axes the ONNX file fixes pinned to that size
    profile: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.profile:
            object.__setattr__(self, "profile", MappingProxyType(dict(self.graph_spec.profile())))


@dataclass(frozen=True)
class LayerSummary:
    """Layers of one engine per precision, from its ``--exportLayerInfo`` JSON."""

    counts: Mapping[str, int]
    reformats: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        parts = [f"{n} {p}" for p, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        head = ", ".join(parts) if parts else "no layers"
        plural = lambda n, word: f"{n} {word}" + ("" if n == 1 else "s")
        return f"{head} ({plural(self.total, 'layer')}, {plural(self.reformats, 'reformat')})"


@dataclass
class BuildResult:
    plan: BuildPlan
    command: list[str] = field(default_factory=list)  # trtexec argv, empty for the python builder
    summary: LayerSummary | None = None


# --------------------------------------------------------------------------- shapes and commands


def shape_spec(spec: GraphSpec | Mapping, which: str) -> str:
    """trtexec ``--{min,opt,max}Shapes`` value: ``name:2x80x4,mask:2x1x4,...`` in input order.

    ``spec`` is a :class:`GraphSpec` (its :meth:`~GraphSpec.profile`) or a profile mapping.
    """
    index = {"min": 0, "opt": 1, "max": 2}[which]
    profile = spec.profile() if isinstance(spec, GraphSpec) else spec
    parts = []
    for name, shapes in profile.items():
        dims = shapes[index]
        parts.append(f"{name}:{'x'.join(str(d) for d in dims) if dims else 'scalar'}")
    return ",".join(parts)


def onnx_input_dims(path: str | Path) -> dict[str, tuple[int | None, ...]] | None:
    """Input dims of an ONNX file: the size where the file fixes an axis, ``None`` where it is symbolic.

    ``None`` when the file cannot be read as a graph with inputs (an empty placeholder, no ``onnx`` module):
    the shape spec is used as it is then, and TensorRT's parser reports a bad file.
    """
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return None
    inits = {i.name for i in model.graph.initializer}
    dims = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        shape = value.type.tensor_type.shape.dim
        dims[value.name] = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                                 for d in shape)
    return dims or None


def fit_profile(spec: GraphSpec, dims: Mapping[str, tuple[int | None, ...]] | None
                ) -> tuple[dict[str, tuple[tuple[int, ...], ...]], list[str]]:
    """The spec's profile with every axis that the ONNX file fixes pinned to the file's size, and a note per
    pinned axis (e.g. a shipped graph whose batch axis stays 1). Inputs, ranks or fixed sizes that contradict
    the spec raise :class:`EngineBuildError`: the export does not match :data:`GRAPHS`."""
    profile = dict(spec.profile())
    if dims is None:
        return profile, []
    if set(dims) != set(profile):
        raise EngineBuildError(f"{spec.name}: ONNX inputs {sorted(dims)} differ from the shape spec's "
                               f"{sorted(profile)}")
    notes = []
    for name, (lo, opt, hi) in profile.items():
        fixed = dims[name]
        if len(fixed) != len(lo):
            raise EngineBuildError(f"{spec.name}: input {name} has rank {len(fixed)} in the ONNX file, "
                                   f"{len(lo)} in the shape spec")
        pinned = [list(lo), list(opt), list(hi)]
        for axis, size in enumerate(fixed):
            if size is None or lo[axis] == hi[axis] == size:
                continue
            if lo[axis] == hi[axis]:
                raise EngineBuildError(f"{spec.name}: input {name} axis {axis} is {size} in the ONNX file, "
                                       f"{lo[axis]} in the shape spec")
            for shape in pinned:
                shape[axis] = size
            notes.append(f"{name} axis {axis} is fixed to {size} in the ONNX file (spec {lo[axis]}..{hi[axis]})")
        profile[name] = tuple(tuple(shape) for shape in pinned)
    return profile, notes


def _select_graphs(graphs: Iterable[str] | None) -> tuple[list[str], dict[str, str]]:
    """Graphs to build and the skipped ones with their reason."""
    skipped: dict[str, str] = {}
    if graphs is None:
        selected = []
        for name in GRAPHS:
            if name in EXCLUDED:
                skipped[name] = EXCLUDED[name].reason
            else:
                selected.append(name)
        return selected, skipped
    selected = []
    for name in graphs:
        if name not in GRAPHS:
            raise ValueError(f"unknown graph {name!r}; graphs: {', '.join(GRAPHS)}")
        ex = EXCLUDED.get(name)
        if ex is not None and not ex.overridable:
            raise ValueError(f"{name} cannot be built with TensorRT: {ex.reason}")
        if name not in selected:
            selected.append(name)
    return selected, skipped


def plan_builds(onnx_dir: str | Path, engine_dir: str | Path, *, precision: str,
                graphs: Iterable[str] | None = None, options: BuildOptions | None = None
                ) -> tuple[list[BuildPlan], dict[str, str]]:
    """One :class:`BuildPlan` per selected graph, and the skipped graphs with their reason.

    A graph without an ONNX file of the requested precision uses the next one in :data:`ONNX_FALLBACK`
    (its note says so); with no file at all the plan points at the preferred path, ``onnx_exists=False``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    options = options or BuildOptions()
    onnx_dir, engine_dir = Path(onnx_dir), Path(engine_dir)
    selected, skipped = _select_graphs(graphs)
    plans = []
    for name in selected:
        candidates = ONNX_FALLBACK[precision]
        found = next((p for p in candidates if (onnx_dir / p / f"{name}.onnx").is_file()), None)
        note, exists = "", found is not None
        if found is None:
            found = candidates[0]
            note = "missing: " + " and ".join(str(onnx_dir / p / f"{name}.onnx") for p in candidates)
        elif found != precision:
            note = f"no {precision} ONNX for {name}: building the {found} graph {onnx_dir / found / f'{name}.onnx'}"
        weak = precision == "fp16" and found == "fp32" and options.weak_fp16
        if weak:
            note += " with --fp16 (weak typing, builder-chosen fp16)"
        onnx_path = onnx_dir / found / f"{name}.onnx"
        profile, pinned = fit_profile(GRAPHS[name], onnx_input_dims(onnx_path) if exists else None)
        note = "; ".join(n for n in (note, *pinned) if n)
        out = engine_dir / precision
        plans.append(BuildPlan(
            graph=name, graph_spec=GRAPHS[name], precision=precision, onnx_precision=found,
            onnx_path=onnx_path,
            engine_path=out / f"{name}.plan", layers_path=out / f"{name}.layers.json",
            log_path=out / f"{name}.build.log", timing_cache=engine_dir / TIMING_CACHE_NAME,
            strongly_typed=not weak, weak_fp16=weak, no_tf32=precision == "fp32",
            note=note, onnx_exists=exists, profile=MappingProxyType(profile),
        ))
    return plans, skipped


def trtexec_command(plan: BuildPlan, options: BuildOptions | None = None, trtexec: str = "trtexec") -> list[str]:
    """The trtexec argv of one build (its stdout+stderr go to ``plan.log_path``)."""
    options = options or BuildOptions()
    cmd = [
        trtexec,
        f"--onnx={plan.onnx_path}",
        f"--saveEngine={plan.engine_path}",
        f"--minShapes={shape_spec(plan.profile, 'min')}",
        f"--optShapes={shape_spec(plan.profile, 'opt')}",
        f"--maxShapes={shape_spec(plan.profile, 'max')}",
    ]
    if plan.strongly_typed:
        cmd.append("--stronglyTyped")
    if plan.weak_fp16:
        cmd.append("--fp16")
    if plan.no_tf32:
        cmd.append("--noTF32")
    cmd += [
        f"--timingCacheFile={plan.timing_cache}",
        "--profilingVerbosity=detailed",
        f"--exportLayerInfo={plan.layers_path}",
        f"--builderOptimizationLevel={options.opt_level}",
        f"--memPoolSize=workspace:{options.workspace_mib}",
    ]
    if options.iterations:
        cmd += [f"--shapes={shape_spec(plan.profile, 'opt')}", f"--iterations={options.iterations}",
                "--warmUp=0", "--duration=0"]
    else:
        cmd.append("--skipInference")
    if options.verbose:
        cmd.append("--verbose")
    return cmd


def shell_line(cmd: list[str], log_path: Path) -> str:
    return f"{shlex.join(cmd)} > {shlex.quote(str(log_path))} 2>&1"


def find_trtexec() -> str | None:
    """``$TRTEXEC``, then ``trtexec`` on PATH, then the NGC container's path."""
    env = os.environ.get("TRTEXEC")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("trtexec")
    if found:
        return found
    return TRTEXEC_NGC_PATH if Path(TRTEXEC_NGC_PATH).is_file() else None


# --------------------------------------------------------------------------- layer report

_DTYPE_WORDS = {
    "fp32": "FP32", "float": "FP32", "fp16": "FP16", "half": "FP16", "bf16": "BF16", "bfloat16": "BF16",
    "fp8": "FP8", "fp4": "FP4", "int8": "INT8", "int4": "INT4", "int16": "INT16", "int32": "INT32",
    "int64": "INT64", "uint8": "UINT8", "bool": "BOOL", "double": "FP64",
}


def tensor_dtype(fmt: str) -> str:
    """Data type in an engine-inspector ``Format/Datatype`` string.

    Both spellings occur: long ones (``"Row major linear FP32"``, ``"Thirty-two wide channel vectorized row
    major Int8 format"``, ``"Channel major FP16 format where channel % 8 == 0"``) and the short ones of fused
    (Myelin/kgen) regions (``"Half"``, ``"Float"``, ``"Int32"``).
    """
    for word in re.findall(r"[A-Za-z0-9]+", fmt):
        dtype = _DTYPE_WORDS.get(word.lower())
        if dtype:
            return dtype
    return "UNKNOWN"


def layer_precision(layer: Mapping) -> str:
    """The type a layer computes in: its first input's (what its kernel reads), else its first output's."""
    for key in ("Inputs", "Outputs"):
        tensors = layer.get(key) or []
        if tensors:
            return tensor_dtype(str(tensors[0].get("Format/Datatype", "")))
    weights = layer.get("Weights")
    if isinstance(weights, Mapping) and "Type" in weights:
        return tensor_dtype(str(weights["Type"]))
    return "NONE"


def summarize_layer_info(info: str | Path | Mapping) -> LayerSummary:
    """Counts per precision of the layers in a ``--exportLayerInfo`` JSON (a path, JSON text or parsed)."""
    if isinstance(info, Mapping):
        data = info
    elif isinstance(info, str) and info.lstrip().startswith("{"):
        data = json.loads(info)
    else:
        data = json.loads(Path(info).read_text())
    layers = data.get("Layers") if isinstance(data, Mapping) else None
    if not isinstance(layers, list):
        raise ValueError("not an engine layer report: no 'Layers' list")
    if layers and not isinstance(layers[0], Mapping):
        raise ValueError("the layer report has layer names only: build with --profilingVerbosity=detailed")
    counts: Counter[str] = Counter()
    reformats = 0
    for layer in layers:
        if layer.get("LayerType") in ("signal", "wait"):  # stream synchronisation, not compute
            continue
        counts[layer_precision(layer)] += 1
        if layer.get("LayerType") == "Reformat" or layer.get("ParameterType") == "Reformat":
            reformats += 1
    return LayerSummary(counts=dict(counts), reformats=reformats)


def summary_line(plan: BuildPlan, summary: LayerSummary) -> str:
    return f"{plan.graph} {plan.precision}: {summary.describe()}"


# --------------------------------------------------------------------------- TensorRT Python API


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise EngineBuildError(TENSORRT_NOT_INSTALLED) from e
    return tensorrt


def build_engine_python(plan: BuildPlan, options: BuildOptions | None = None) -> None:
    """Build one engine with the TensorRT Python API: the same profile, typing, timing cache and report as
    the trtexec command, the layer report from the engine inspector."""
    trt = import_tensorrt()
    options = options or BuildOptions()
    plan.engine_path.parent.mkdir(parents=True, exist_ok=True)

    class FileLogger(trt.ILogger):
        def __init__(self, stream):
            trt.ILogger.__init__(self)
            self.stream = stream

        def log(self, severity, msg):
            if options.verbose or int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.stream.write(f"[{severity.name}] {msg}\n")

    with open(plan.log_path, "w") as stream:
        logger = FileLogger(stream)
        builder = trt.Builder(logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if plan.strongly_typed else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(plan.onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineBuildError(f"{plan.graph}: TensorRT cannot parse {plan.onnx_path}: {errors}")

        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
        config.builder_optimization_level = options.opt_level
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        if plan.weak_fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        if plan.no_tf32:
            config.clear_flag(trt.BuilderFlag.TF32)
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in plan.profile.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        cache_bytes = plan.timing_cache.read_bytes() if plan.timing_cache.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)

        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise EngineBuildError(f"{plan.graph}: TensorRT build failed, see {plan.log_path}")
        plan.engine_path.write_bytes(serialized)  # IHostMemory is a buffer
        plan.timing_cache.write_bytes(config.get_timing_cache().serialize())

        engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
        inspector = engine.create_engine_inspector()
        plan.layers_path.write_text(inspector.get_engine_information(trt.LayerInformationFormat.JSON))


# --------------------------------------------------------------------------- driver


def _run_trtexec(cmd: list[str], plan: BuildPlan) -> None:
    with open(plan.log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = plan.log_path.read_text(errors="replace").splitlines()[-20:]
        raise EngineBuildError(f"{plan.graph}: trtexec exited {rc}; last lines of {plan.log_path}:\n"
                               + "\n".join(tail))


def build_engines(onnx_dir: str | Path = "build/onnx", engine_dir: str | Path = "build/engines", *,
                  precision: str = "fp16", graphs: Iterable[str] | None = None, builder: str = "trtexec",
                  dry_run: bool = False, options: BuildOptions | None = None,
                  log: Callable[[str], None] = print) -> list[BuildResult]:
    """Build (or, with ``dry_run``, print) the engines of ``graphs`` (default: all but :data:`EXCLUDED`).

    Real builds need ``trtexec`` (``builder="trtexec"``) or the ``tensorrt`` module (``"python"``), i.e. the
    NGC container; without them :class:`EngineBuildError` says so before anything is written.
    """
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")
    options = options or BuildOptions()
    plans, skipped = plan_builds(onnx_dir, engine_dir, precision=precision, graphs=graphs, options=options)
    for name, reason in skipped.items():
        log(f"skip {name}: {reason}")

    trtexec = "trtexec"
    if not dry_run:
        if builder == "trtexec":
            trtexec = find_trtexec() or ""
            if not trtexec:
                raise EngineBuildError(TRTEXEC_NOT_FOUND)
        else:
            import_tensorrt()
        missing = [p for p in plans if not p.onnx_exists]
        if missing:
            raise EngineBuildError("ONNX files not found (run export/export_onnx.py first): "
                                   + "; ".join(p.note.removeprefix("missing: ") for p in missing))

    results = []
    for i, plan in enumerate(plans, 1):
        cmd = trtexec_command(plan, options, trtexec) if builder == "trtexec" else []
        result = BuildResult(plan, cmd)
        results.append(result)
        head = f"[{i}/{len(plans)}] {plan.graph} {plan.precision}"
        if plan.note:
            log(f"{head}: {plan.note}")
        if dry_run:
            if builder == "trtexec":
                log(shell_line(cmd, plan.log_path))
            else:
                typing = "strongly typed" if plan.strongly_typed else "weak fp16"
                log(f"python builder: {plan.onnx_path} -> {plan.engine_path} ({typing}, "
                    f"profile {dict(plan.profile)}, timing cache {plan.timing_cache})")
            continue
        log(f"{head}: building {plan.engine_path} from {plan.onnx_path}")
        plan.engine_path.parent.mkdir(parents=True, exist_ok=True)
        if builder == "trtexec":
            _run_trtexec(cmd, plan)
        else:
            build_engine_python(plan, options)
        result.summary = summarize_layer_info(plan.layers_path)
        log(summary_line(plan, result.summary))
    return results
