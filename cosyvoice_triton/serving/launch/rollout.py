"""Model version rollouts of the served voice conversion: numbered versions, a server-side traffic split, checks.

A *version* is a model folder (checkpoint) plus an export and a precision choice. The render
(:func:`cosyvoice_triton.serving.repository.render_repository` with ``versions=``) writes every version it is given
into one repository, as Triton's numbered versions:

* the six graphs and the two BLS stages that call them (``flow``, ``hift``: :data:`VERSIONED`) get one folder per
  version (``flow_encoder/2/model.onnx``, ``flow/2/model.py``); ``flow`` / ``hift`` version N call the graphs'
  version N (parameter ``pin_graph_version``). Their ``version_policy`` names the versions to load: the live one,
  and the candidate beside it while one is staged. The rollout rewrites that line of the rendered config and loads
  the model (not a config override: loading a pipeline ensemble makes Triton load its steps from the repository
  again, which would drop a version only an override named); so a restart serves the versions last set.
* each version gets its pipeline, ``cosyvoice_vc_v<N>`` (:func:`pipeline_model`): the ``cosyvoice_vc`` ensemble
  with the graph and BLS steps pinned to version N, and the version's manifest (:data:`MANIFEST_NAME`: checkpoint
  digests, the export's files and digests, the precision of each graph, the model's settings).
  An ensemble's steps are part of its config, which Triton shares between an ensemble's numbered versions, so the
  pipeline of a version is a model of its own rather than a numbered version of one ensemble.
* the public name ``cosyvoice_vc`` is the router (``ensemble/cosyvoice_vc_router``): a Python BLS model with the
  ensemble's inputs and outputs that sends each request to a version's pipeline by :class:`Split`.

The split lives in the router's config ``parameters`` and changes by loading the router with a config override
through Triton's model-repository API (:meth:`Rollout.canary`). Why this and not something else: Triton has no
traffic split of its own; the repository API is already the restricted admin API (it needs the admin key,
inference does not), a reload is atomic for clients (Triton serves with the old instances until the new ones are
ready, and lets the old ones finish what they hold), the current split is readable through the model-config API
(``status``), and a restart falls back to the rendered config (the live version at 100%), the safe state. A
control input on the inference API would be open to every client; a file the router polls would bypass both
the key and Triton's view of the model.

:class:`Rollout` drives a running server (``python -m cosyvoice_triton rollout status|stage|canary|promote|
rollback``). ``stage`` refuses a version that fails its checks before any request reaches it: its model folder
no longer holds the checkpoint it was rendered with or has another model's settings (wrong checkpoint), its export
was made from other checkpoint files or its served files differ from the export (out of date), or its pipeline's
output on a fixed input differs from the live version's beyond a log-mel distance (parity smoke test; the
candidate pipeline is called directly, never through the router).

**Across families.** A CosyVoice3 version (its pipeline is ``cosyvoice3_vc`` on its folder, in process) is staged,
put on canary, promoted and rolled back the same way from a CosyVoice2 live version, and back. Its checks are the
checkpoint digests (a family change has other settings by design: they are not compared), and instead of parity,
which a new family cannot meet, a smoke test (:data:`SMOKE_DURATION`): the candidate's answer to the fixed input is
finite, within [-1, 1] and as long as the live version's within 5 %. Promoting a CosyVoice3 version unloads the
CosyVoice2 graphs and stages (no version of theirs is live); staging a CosyVoice2 version loads them again. The
router leaves ``seed`` out of a CosyVoice3 version's requests (router parameter ``seedless_versions``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...family import COSYVOICE2, COSYVOICE3, FAMILY_YAML
from ...hashing import file_sha256
from ...shapes import GRAPHS, VC_MODEL
from ..versioning import (  # re-exported: the public names here
    CHECKPOINT_FILES,
    MANIFEST_NAME,
    ROUTER_PARAMS,
    VERSIONED,
    VersionSpec,
    pipeline_model,
    version_manifest,
)

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_FILES", "DRAIN_SETTLE_S", "MANIFEST_NAME", "PARITY_DB", "ROUTER_MODEL", "ROUTER_PARAMS",
           "SMOKE_DURATION", "VERSIONED", "Rollout", "RolloutError", "RolloutRefused", "Split", "VersionSpec",
           "check_version", "pipeline_gone", "pipeline_model", "read_manifests", "startup_models", "version_manifest"]

ROUTER_MODEL = VC_MODEL
#: Parity smoke test: largest mean |log-mel difference| (dB) of the candidate's output against the live version's
#: (the quality report's bar for a reduced-precision vocoder, :data:`cosyvoice_triton.export.quality.BAR`).
PARITY_DB = 0.5
#: Smoke test of a version of another family than the live one: largest relative difference of its answer's length
#: from the live version's on the fixed input (both convert the same source: the same duration).
SMOKE_DURATION = 0.05
#: Drain: a dropped version's stages must show no new work in Triton's statistics for this long (seconds) before
#: they lose the version (longer than the gap between two graph calls of one BLS request on a loaded machine).
DRAIN_SETTLE_S = 3.0


def startup_models(repository: str | Path) -> list[str]:
    """What a server on a versioned repository loads at start (``--model-control-mode=explicit``): the live
    version's pipeline with the models it calls by BLS, and the router."""
    marker = json.loads((Path(repository) / "cosyvoice_repository.json").read_text())
    live = int(marker.get("live_version") or 0)
    if not live:
        raise RolloutError(f"{repository} was not rendered with versions")
    return [*GRAPHS, "flow", "hift", "preprocess", "postprocess", pipeline_model(live), ROUTER_MODEL]


_POLICY = re.compile(r"version_policy \{ specific \{ versions: \[[^\]]*\] \} \}")


_GONE = ("is not available", "unknown model", "is not found", "not ready", "not at ready state",
         "has no available versions")


def pipeline_gone(message: str, model: str) -> bool:
    """Does a failed forward's error say that ``model`` itself was not there (unloaded, unloading, not ready), so
    that the request never ran and may go to another version? (A router instance being replaced can still hold
    requests picked for a version that a promote or rollback is unloading.)"""
    return f"'{model}'" in message and "in ensemble" not in message and any(g in message for g in _GONE)


class RolloutError(RuntimeError):
    """A rollout step that cannot be done (nothing staged, unknown version, a load that failed)."""


class RolloutRefused(RolloutError):
    """A version that failed its checks; ``problems`` lists each, and nothing was routed to it."""

    def __init__(self, version: int, problems: Iterable[str]):
        self.version, self.problems = int(version), list(problems)
        super().__init__(f"version {version} refused: " + "; ".join(self.problems))


# ------------------------------------------------------------------------------------------------ versions


def read_manifests(repository: str | Path) -> dict[int, dict[str, Any]]:
    """Version number -> manifest of every version rendered into ``repository``."""
    out = {}
    for path in sorted(Path(repository).glob(f"{VC_MODEL}_v*/{MANIFEST_NAME}")):
        doc = json.loads(path.read_text())
        out[int(doc["version"])] = doc
    return out


def manifest_family(manifest: Mapping[str, Any]) -> str:
    """The family of a rendered version (manifests written before families were recorded: CosyVoice2)."""
    return str(manifest.get("family") or COSYVOICE2)


def check_version(manifest: Mapping[str, Any], live: Mapping[str, Any] | None = None) -> list[str]:
    """The problems of a rendered version, read from disk now (empty: none). Wrong checkpoint: a file of the model
    folder differs from the digest recorded at render time, or the model's settings differ from the live
    version's of the same family. Out of date: a graph's export was made from other checkpoint bytes than the
    folder holds, or the served file differs from the export's record."""
    problems = []
    model_dir = Path(manifest["model_dir"])
    now: dict[str, str] = {}
    for f, digest in manifest["checkpoint"].items():
        path = model_dir / f
        now[f] = file_sha256(path) if path.is_file() else ""
        if now[f] != digest:
            problems.append(f"wrong checkpoint: {path} is {'missing' if not now[f] else 'not the file'} the version "
                            f"was rendered with (sha256 {digest[:12]}, now {now[f][:12] or '-'})")
    family = manifest_family(manifest)
    same_family = live is not None and manifest_family(live) == family
    if same_family and live.get("settings") != manifest.get("settings"):
        diff = sorted(k for k in set(live.get("settings", {})) | set(manifest.get("settings", {}))
                      if live.get("settings", {}).get(k) != manifest.get("settings", {}).get(k))
        problems.append(f"wrong checkpoint: {model_dir}/{FAMILY_YAML[family]} has other settings than the live "
                        f"version {live.get('version')} ({', '.join(diff)}): not a drop-in replacement")
    for name, g in manifest["graphs"].items():
        if not g["source_sha256"]:
            problems.append(f"export out of date: {name}: no export manifest records what {g['file']} was made from")
            continue
        held = now.get(g["source_file"])
        if held is None:
            src = model_dir / g["source_file"]
            held = file_sha256(src) if src.is_file() else ""
        if held != g["source_sha256"]:
            problems.append(f"export out of date: {name} was exported from {g['source_file']} sha256 "
                            f"{g['source_sha256'][:12]}, the model folder holds {held[:12] or 'no such file'} "
                            f"(export again: make export MODEL_DIR={model_dir})")
        path = Path(g["file"])
        served = file_sha256(path) if path.is_file() else ""
        if g["export_sha256"] and served and g["sha256"] and served != g["sha256"]:
            problems.append(f"export out of date: {path} changed since the render (sha256 {served[:12]}, rendered "
                            f"{g['sha256'][:12]})")
    return problems


# --------------------------------------------------------------------------------------------- traffic split


@dataclass
class Split:
    """Shares of requests per version, picked by smooth weighted round robin: over any ``sum(weights)``
    consecutive picks each version gets exactly its weight, interleaved (no bursts of one version), and over any
    ``n`` consecutive picks within 1 of ``n * share``."""

    weights: dict[int, int]
    _current: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.weights = {int(v): int(w) for v, w in self.weights.items()}
        if any(w < 0 for w in self.weights.values()) or not any(self.weights.values()):
            raise ValueError(f"split {self.weights}: weights must be >= 0 and one of them > 0")
        self._current = {v: 0 for v in self.weights}

    @classmethod
    def parse(cls, text: str) -> Split:
        weights = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            v, sep, w = part.partition(":")
            if not sep or not v.strip().isdigit() or not w.strip().isdigit():
                raise ValueError(f"split {text!r}: expected VERSION:WEIGHT[,VERSION:WEIGHT...], got {part!r}")
            weights[int(v)] = int(w)
        return cls(weights)

    def start_anywhere(self, rng=None) -> Split:
        """Begin at a random point of the cycle (each router instance keeps its own), so that the instances'
        picks together get each version's share even over fewer requests than one cycle."""
        import random

        for _ in range((rng or random).randrange(sum(self.weights.values()))):
            self.choose()
        return self

    def format(self) -> str:
        return ",".join(f"{v}:{w}" for v, w in sorted(self.weights.items()))

    def percent(self, version: int) -> float:
        return 100.0 * self.weights.get(int(version), 0) / sum(self.weights.values())

    def choose(self) -> int:
        total = sum(self.weights.values())
        for v, w in self.weights.items():
            self._current[v] += w
        best = max(self._current, key=lambda v: (self._current[v], -v))
        self._current[best] -= total
        return best


# ------------------------------------------------------------------------------------------ against a server


@dataclass
class Status:
    live: int
    candidate: int
    split: dict[int, float]  # version -> percent
    ready: dict[int, bool]  # version -> its pipeline is ready
    requests: dict[int, int]  # version -> successful requests of its pipeline (Triton's statistics)
    failures: dict[int, int]
    loaded: dict[str, list[int]]  # versioned model -> versions ready
    rendered: list[int]

    def describe(self) -> str:
        lines = [f"live version {self.live}" + (f", candidate {self.candidate}" if self.candidate else
                                                ", nothing staged"),
                 "split: " + ", ".join(f"v{v} {p:.0f}%" for v, p in sorted(self.split.items()))]
        for v in self.rendered:
            lines.append(f"  v{v} {pipeline_model(v):<18} {'ready' if self.ready.get(v) else 'not loaded':<10} "
                         f"{self.requests.get(v, 0):>7} ok {self.failures.get(v, 0):>5} failed")
        return "\n".join(lines)


class Rollout:
    """Rollout steps against a running server whose repository was rendered with versions.

    Args:
        url: the server's HTTP endpoint (``host:port``).
        repository: the rendered repository (the versions' manifests are read from it).
        admin_key: the key of the restricted APIs (default: ``$COSYVOICE_TRITON_ADMIN_KEY``, or the server's
            ``admin_key`` file beside the repository, ``<repository>/../triton/admin_key``).
        parity_db: the parity smoke test's bar (:data:`PARITY_DB`).
    """

    def __init__(self, url: str, repository: str | Path, *, admin_key: str | None = None,
                 parity_db: float = PARITY_DB, timeout: float = 600.0, drain_settle: float = DRAIN_SETTLE_S):
        import tritonclient.http as httpclient

        from ...admin import ADMIN_KEY_ENV, admin_headers

        self.url, self.repository = url, Path(repository)
        if admin_key is None:
            import os

            key_file = self.repository.resolve().parent / "triton" / "admin_key"
            admin_key = os.environ.get(ADMIN_KEY_ENV) or (key_file.read_text().strip() if key_file.is_file()
                                                          else None)
        if not admin_key:
            raise RolloutError(f"no admin key: set ${ADMIN_KEY_ENV} (the server's <work_dir>/admin_key)")
        self.headers = admin_headers("http", admin_key)
        self.parity_db = float(parity_db)
        self.drain_timeout = float(timeout)
        self.drain_settle = float(drain_settle)
        self.client = httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
        self.manifests = read_manifests(self.repository)
        if not self.manifests:
            raise RolloutError(f"{self.repository} has no versions ({VC_MODEL}_v*/{MANIFEST_NAME}): render it with "
                               "versions (render.py --version N:MODEL_DIR:ONNX_DIR[:PRECISION])")

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- reading

    def router_config(self) -> dict[str, Any]:
        return self.client.get_model_config(ROUTER_MODEL, headers=self.headers)

    def _state(self) -> tuple[dict[str, Any], dict[str, str]]:
        cfg = self.router_config()
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        return cfg, params

    def status(self) -> Status:
        _, p = self._state()
        split = Split.parse(p["split"])
        index = self.client.get_model_repository_index(headers=self.headers)
        loaded: dict[str, list[int]] = {}
        ready_models = set()
        for m in index:
            if m.get("state") == "READY":
                ready_models.add(m["name"])
                if m["name"] in VERSIONED and m.get("version"):
                    loaded.setdefault(m["name"], []).append(int(m["version"]))
        requests, failures, ready = {}, {}, {}
        for v in self.manifests:
            ready[v] = pipeline_model(v) in ready_models
            if ready[v]:
                requests[v], failures[v] = self.counts(v)
        return Status(int(p["live_version"]), int(p.get("candidate_version", 0)),
                      {v: split.percent(v) for v in split.weights}, ready, requests, failures,
                      {k: sorted(v) for k, v in loaded.items()}, sorted(self.manifests))

    def counts(self, version: int) -> tuple[int, int]:
        """(successful, failed) requests of a version's pipeline since it was loaded (Triton's statistics; (0, 0)
        when it is not loaded)."""
        if not self.client.is_model_ready(pipeline_model(version)):
            return 0, 0
        stats = self.client.get_inference_statistics(pipeline_model(version), headers=self.headers)
        ok = fail = 0
        for s in stats.get("model_stats", []):
            ok += int(s["inference_stats"]["success"]["count"])
            fail += int(s["inference_stats"]["fail"]["count"])
        return ok, fail

    # ----------------------------------------------------------------------------------------- steps

    def stage(self, version: int) -> dict[str, Any]:
        """Check ``version``, load it beside the live one and compare it with the live one on a fixed input
        (:meth:`parity`, or :meth:`smoke` across families); the router sends it nothing yet. Returns the
        comparison's figures; raises :class:`RolloutRefused` (everything it loaded unloaded again)."""
        version = int(version)
        _, p = self._state()
        live, cand = int(p["live_version"]), int(p.get("candidate_version", 0))
        if version not in self.manifests:
            raise RolloutError(f"version {version} is not rendered in {self.repository} (versions: "
                               f"{sorted(self.manifests)})")
        if version == live:
            raise RolloutError(f"version {version} is the live version")
        if cand and cand != version:
            raise RolloutError(f"version {cand} is staged: promote or roll it back first")
        problems = check_version(self.manifests[version], self.manifests.get(live))
        if problems:
            raise RolloutRefused(version, problems)
        log.info("stage v%d: checks passed; loading it beside v%d", version, live)
        try:
            exported = [v for v in (live, version) if self.family(v) == COSYVOICE2]
            if exported:
                self._set_versions(exported)
            self._load(pipeline_model(version))
            parity = (self.parity(version, live) if self.family(version) == self.family(live)
                      else self.smoke(version, live))
        except Exception:
            self._drop(version, live)
            raise
        if not parity["passed"]:
            self._drop(version, live)
            raise RolloutRefused(version, [parity["problem"]])
        self._set_router(live=live, candidate=version, split={live: 100, version: 0})
        return parity

    def canary(self, percent: float) -> Split:
        """Send ``percent`` of the requests to the staged version (whole percents)."""
        _, p = self._state()
        live, cand = int(p["live_version"]), int(p.get("candidate_version", 0))
        if not cand:
            raise RolloutError("nothing staged: stage a version first")
        pct = round(float(percent))
        if not 0 <= pct <= 100:
            raise RolloutError(f"percent must be within 0..100, got {percent}")
        split = {live: 100 - pct, cand: pct}
        self._set_router(live=live, candidate=cand, split=split)
        return Split(split)

    def promote(self) -> int:
        """Make the staged version the live one (100%) and unload the previous one."""
        _, p = self._state()
        live, cand = int(p["live_version"]), int(p.get("candidate_version", 0))
        if not cand:
            raise RolloutError("nothing staged: stage a version first")
        self._set_router(live=cand, candidate=0, split={cand: 100})
        self._drop(live, cand)
        return cand

    def rollback(self) -> int:
        """Send everything back to the live version and unload the staged one."""
        _, p = self._state()
        live, cand = int(p["live_version"]), int(p.get("candidate_version", 0))
        if not cand:
            raise RolloutError("nothing staged: nothing to roll back")
        self._set_router(live=live, candidate=0, split={live: 100})
        self._drop(cand, live)
        return live

    # ----------------------------------------------------------------------------------------- parity

    def family(self, version: int) -> str:
        """The family of a rendered version (its manifest's)."""
        return manifest_family(self.manifests[int(version)])

    def _answers(self, version: int, live: int, seed: int):
        from ..samples import stage_warmup_samples

        sample = stage_warmup_samples("preprocess", 2.0)
        return [self._infer(pipeline_model(v), sample, None if self.family(v) == COSYVOICE3 else seed)
                for v in (version, live)]

    def smoke(self, version: int, live: int) -> dict[str, Any]:
        """A version of another family than the live one on the fixed input: its answer is finite, within [-1, 1]
        and as long as the live version's within :data:`SMOKE_DURATION` (parity cannot hold across families)."""
        import numpy as np

        a, b = self._answers(version, live, 0)
        diff = abs(a.size - b.size) / max(b.size, 1)
        problem = ""
        if not a.size or not np.all(np.isfinite(a)) or float(np.max(np.abs(a))) > 1.0:
            problem = (f"smoke: v{version} ({self.family(version)}) gave {a.size} samples, "
                       f"{'finite' if np.all(np.isfinite(a)) else 'not finite'}, peak "
                       f"{float(np.max(np.abs(a))) if a.size else 0:.3g}")
        elif diff > SMOKE_DURATION:
            problem = (f"smoke: v{version} ({self.family(version)}) answered {a.size} samples, v{live} "
                       f"({self.family(live)}) {b.size} on the same input ({100 * diff:.1f}% apart; the bar is "
                       f"{100 * SMOKE_DURATION:g}%)")
        return {"passed": not problem, "check": "smoke", "db": None, "samples": int(a.size),
                "duration_diff": diff, "problem": problem}

    def parity(self, version: int, live: int, *, seed: int = 0) -> dict[str, Any]:
        """Both pipelines on the same fixed input and seed: the mean |log-mel difference| of their outputs."""
        import numpy as np

        from ...export.quality import logmel_db

        a, b = self._answers(version, live, seed)
        if a.shape != b.shape or not np.all(np.isfinite(a)):
            return {"passed": False, "db": float("inf"), "problem": f"parity: v{version} gave {a.shape} "
                    f"({'finite' if np.all(np.isfinite(a)) else 'not finite'}), v{live} {b.shape} on the same input"}
        db, _ = logmel_db(a, b)
        passed = db <= self.parity_db
        return {"passed": passed, "check": "parity", "db": db, "samples": int(a.size),
                "problem": "" if passed else f"parity: v{version}'s output is {db:.2f} dB (mean |log-mel "
                f"difference|) from v{live}'s on the fixed input; the bar is {self.parity_db:g} dB"}

    def _infer(self, model: str, sample: Mapping[str, Any], seed: int | None):
        import numpy as np
        import tritonclient.http as httpclient

        tensors = {k: sample[k][None] for k in ("source_audio", "source_sample_rate", "prompt_audio",
                                                 "prompt_sample_rate")}
        if seed is not None:
            tensors["seed"] = np.array([[seed]], np.int64)
        inputs = []
        for name, arr in tensors.items():
            dtype = {"float32": "FP32", "int32": "INT32", "int64": "INT64"}[str(arr.dtype)]
            t = httpclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        res = self.client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("waveform")])
        return res.as_numpy("waveform").reshape(-1)

    # ----------------------------------------------------------------------------------------- loading

    def _load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        try:
            self.client.load_model(model, headers=self.headers,
                                   config=json.dumps(config) if config is not None else None)
        except Exception as exc:
            raise RolloutError(f"load of {model} failed: {exc}") from exc

    def _set_versions(self, versions: Iterable[int], order: Iterable[str] = VERSIONED) -> None:
        """Serve exactly ``versions`` of every versioned model: the ``version_policy`` of its rendered config, then
        a load. On disk, not as a config override: loading a pipeline (an ensemble) makes Triton load its steps
        from the repository again, which would drop a version that only an override named."""
        numbers = sorted({int(v) for v in versions})
        for m in order:
            path = self.repository / m / "config.pbtxt"
            text = path.read_text()
            new, n = _POLICY.subn(f"version_policy {{ specific {{ versions: [ {', '.join(map(str, numbers))} ] }} }}",
                                  text)
            if n != 1:
                raise RolloutError(f"{path}: no version_policy line (not rendered with versions?)")
            if new == text and self.client.is_model_ready(m):
                continue
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(new)
            tmp.replace(path)
            self._load(m)

    def _drop(self, version: int, keep: int) -> None:
        """Unload ``version``'s pipeline, then its versions of the BLS stages, then of the graphs (all of them when
        ``keep`` is a CosyVoice3 version: no CosyVoice2 version is left to serve)."""
        model = pipeline_model(version)
        try:
            self.client.unload_model(model, headers=self.headers)
        except Exception as exc:  # not loaded: nothing to unload
            log.debug("unload %s: %s", model, exc)
        # Triton finishes the pipeline's requests in flight before the unload completes (state UNLOADING until
        # then); only then may its stages lose the version, or a request between two BLS calls would fail
        deadline = time.monotonic() + self.drain_timeout
        while self._state_of(model) in ("READY", "UNLOADING", "LOADING"):
            if time.monotonic() > deadline:
                raise RolloutError(f"{model} still unloading after {self.drain_timeout:.0f} s: its versions are kept")
            time.sleep(0.2)
        if self.family(version) == COSYVOICE3:
            return  # its pipeline was all of it
        # the pipeline reads as unloaded while its BLS stage (flow N) may still run a request that calls the graphs'
        # version N: wait until the version's stages stop counting work before they lose it
        self._wait_stages_quiet(version, deadline)
        if self.family(keep) == COSYVOICE2:
            self._set_versions([keep], ("flow", "hift", *GRAPHS))
            return
        for m in ("flow", "hift", *GRAPHS):
            try:
                self.client.unload_model(m, headers=self.headers)
            except Exception as exc:  # not loaded: nothing to unload
                log.debug("unload %s: %s", m, exc)

    def stage_activity(self, version: int) -> tuple[int, ...]:
        """Triton's work counters of ``version`` of every versioned model (inference, execution, success, fail
        counts); they change while anything still runs in that version (a graph call of a BLS request, too)."""
        sig: list[int] = []
        for m in VERSIONED:
            try:
                stats = self.client.get_inference_statistics(m, model_version=str(int(version)),
                                                             headers=self.headers)
            except Exception as exc:  # that version is not loaded: nothing runs in it
                log.debug("statistics of %s v%d: %s", m, version, exc)
                sig.extend((-1, -1, -1, -1))
                continue
            for s in stats.get("model_stats", []):
                inf = s.get("inference_stats", {})
                sig.extend((int(s.get("inference_count", 0)), int(s.get("execution_count", 0)),
                            int(inf.get("success", {}).get("count", 0)), int(inf.get("fail", {}).get("count", 0))))
        return tuple(sig)

    def _wait_stages_quiet(self, version: int, deadline: float) -> None:
        """Return once :meth:`stage_activity` of ``version`` has not moved for ``drain_settle`` seconds; raise
        :class:`RolloutError` (its versions kept) if it still moves at ``deadline``."""
        last = self.stage_activity(version)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < self.drain_settle:
            if time.monotonic() > deadline:
                raise RolloutError(f"version {version}'s stages still run requests after {self.drain_timeout:.0f} s "
                                   f"of draining: its versions are kept")
            time.sleep(min(0.25, self.drain_settle / 4 or 0.25))
            now = self.stage_activity(version)
            if now != last:
                last, quiet_since = now, time.monotonic()

    def _state_of(self, model: str) -> str:
        for m in self.client.get_model_repository_index(headers=self.headers):
            if m["name"] == model:
                return str(m.get("state", ""))
        return ""

    def _set_router(self, *, live: int, candidate: int, split: Mapping[int, int]) -> None:
        cfg = self.router_config()
        params = cfg.setdefault("parameters", {})
        params["split"] = {"string_value": Split(dict(split)).format()}
        params["live_version"] = {"string_value": str(int(live))}
        params["candidate_version"] = {"string_value": str(int(candidate))}
        self._load(ROUTER_MODEL, cfg)


# ----------------------------------------------------------------------------------------------- command line


def add_parser(sub) -> None:
    """The ``rollout`` subcommand of ``python -m cosyvoice_triton``."""
    r = sub.add_parser("rollout", help="model version rollouts against a running server (status, stage, canary, "
                                       "promote, rollback)")
    r.add_argument("action", choices=("status", "stage", "canary", "promote", "rollback"))
    r.add_argument("value", nargs="?", help="stage: the version number; canary: the percent sent to it")
    r.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP endpoint")
    r.add_argument("--repository", default="build/model_repository", help="the rendered repository it serves")
    r.add_argument("--admin-key", default=None, help="default: $COSYVOICE_TRITON_ADMIN_KEY or <repository>/../"
                                                     "triton/admin_key")
    r.add_argument("--parity-db", type=float, default=PARITY_DB, help="the parity smoke test's bar (dB)")
    r.set_defaults(func=_cmd_rollout)


def _cmd_rollout(args) -> int:
    import sys

    if args.action in ("stage", "canary") and args.value is None:
        print(f"error: rollout {args.action} needs a {'version' if args.action == 'stage' else 'percent'}",
              file=sys.stderr)
        return 2
    try:
        with Rollout(args.url, args.repository, admin_key=args.admin_key, parity_db=args.parity_db) as ro:
            if args.action == "stage":
                check = ro.stage(int(args.value))
                passed = (f"parity {check['db']:.3f} dB (bar {ro.parity_db:g})" if check["check"] == "parity" else
                          f"smoke test across families (length {100 * check['duration_diff']:.1f}% from the live "
                          f"version's, bar {100 * SMOKE_DURATION:g}%)")
                print(f"staged v{args.value}: checks passed, {passed}; it gets no traffic until "
                      "`rollout canary PERCENT`")
            elif args.action == "canary":
                split = ro.canary(float(args.value))
                print("split: " + ", ".join(f"v{v} {split.percent(v):.0f}%" for v in sorted(split.weights)))
            elif args.action == "promote":
                print(f"v{ro.promote()} is live (100%); the previous version is unloaded")
            elif args.action == "rollback":
                print(f"rolled back: v{ro.rollback()} serves 100%; the candidate is unloaded")
            print(ro.status().describe())
    except RolloutRefused as exc:
        print("refused: version " + str(exc.version) + "\n  " + "\n  ".join(exc.problems), file=sys.stderr)
        return 3
    except (RolloutError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
