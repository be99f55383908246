"""The served streaming stages in process, built as the served models build them, from a running server's configs.

Each served Python model reads its config ``parameters`` in ``initialize()`` (:func:`~..serving.stages.params
.read_parameters` with :data:`~..serving.stages.model_params.MODEL_PARAMS`) and builds its stage from them. Here the
same parameters are read over Triton's HTTP API (its model-config API, opened with the admin key) and the same
builders run in this process: :func:`~..serving.stages.vc_stream.build_streamer` (``cosyvoice_vc_stream``),
:func:`~..serving.stages.live_vc.build_live` (``cosyvoice_vc_live``),
:func:`~..serving.stages.tts.service_from_params` (``cosyvoice_tts_stream``, ``cosyvoice_tts_live``) and the
``speakers`` model's :func:`~..serving.stages.speakers.build_service`, with each graph a
:class:`~..serving.stages.graphs.GraphRunner` on the file, runtime, device, thread count and result cache of the
served graph model, instead of a BLS call. So a chunk computed here is the served stage's chunk without the server:
no gRPC, no BLS, no other process. The torch threads of each stage (``torch_threads``) are set by the caller before
it runs that stage (:attr:`InProcessStages.threads`): the served stages each set their own in their process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CosyVoiceError

__all__ = ["InProcessStages", "ServedConfigs"]


class ServedConfigs:
    """The config parameters of a running server's models, as each model read them; its graphs in process.

    ``http_url``: the server's HTTP address (``host:port``); ``admin_key``: its restricted APIs' key (None: this
    process's, which a :class:`~..serving.launch.server.TritonServer` started here uses, or
    ``$COSYVOICE_TRITON_ADMIN_KEY``); ``repository``: the served repository folder on this machine, needed only
    when a graph's ``onnx_path`` is relative (a versioned repository)."""

    def __init__(self, http_url: str, *, admin_key: str | None = None, repository: str | Path | None = None):
        import tritonclient.http as httpclient

        from ..admin import admin_headers, given_admin_key

        self.client = httpclient.InferenceServerClient(http_url, network_timeout=600.0)
        self.headers = admin_headers("http", given_admin_key(admin_key))
        self.repository = None if repository is None else Path(repository)
        self._graphs: dict[str, Any] = {}

    def config(self, model: str) -> dict:
        return self.client.get_model_config(model, headers=self.headers)

    def params(self, model: str, kind: str | None = None) -> dict[str, Any]:
        """The typed parameters ``model`` read (``kind``: its entry of ``MODEL_PARAMS``; default: ``model``)."""
        from ..serving.stages.model_params import MODEL_PARAMS
        from ..serving.stages.params import read_parameters

        return read_parameters(self.config(model), MODEL_PARAMS[kind or model], model=model)

    def graph(self, model: str, graph: str) -> Callable[[Mapping[str, np.ndarray]], dict]:
        """The callable of graph ``graph`` served by the graph model ``model`` (one runner per model, shared): its
        ``run_items`` on one request, as the served graph model answers a BLS call (its result cache included)."""
        if model not in self._graphs:
            from ..serving.stages.graphs import GraphRunner

            p = self.params(model, "graph")
            if p["graph"] != graph:
                raise CosyVoiceError(f"the served model {model} runs graph {p['graph']}, not {graph}")
            onnx_path = p["onnx_path"]
            if onnx_path and not os.path.isabs(onnx_path):
                if self.repository is None:
                    raise CosyVoiceError(f"{model}: onnx_path {onnx_path!r} is relative to the served repository; "
                                         "give the repository folder")
                onnx_path = str(self.repository / model / "1" / onnx_path)
            self._graphs[model] = GraphRunner(p["graph"], onnx_path=onnx_path or None, runtime=p["runtime"],
                                              model_dir=p["model_dir"] or None, device=p["device"],
                                              intra_op_threads=p["intra_op_threads"], cache_mb=p["graph_cache_mb"])
        runner = self._graphs[model]
        return lambda feeds: runner.run_items([feeds])[0].unwrap()  # as the graph model runs a request

    def close(self) -> None:
        self.client.close()


class InProcessStages:
    """The four streaming models' stages in process, as :class:`ServedConfigs` reads them, with an in-process
    ``speakers`` store in ``speaker_dir`` (:meth:`register` puts a speaker there, as the served ``register`` does)."""

    def __init__(self, configs: ServedConfigs, speaker_dir: str | Path):
        from ..serving.stages.speakers import build_service

        self.configs = configs
        p = {**configs.params("speakers"), "speaker_dir": str(speaker_dir)}
        self.speakers = build_service(p, configs.graph)
        #: model -> its torch intra-op threads (``torch_threads``), filled as each stage is built
        self.threads: dict[str, int] = {}
        self._closers: list[Callable[[], Any]] = []

    def register(self, speaker_id: str, wave: np.ndarray, sample_rate: int, prompt_text: str | None) -> None:
        prompt = self.speakers.prompt(np.asarray(wave, np.float32)[None], np.array([[sample_rate]], np.int32), None,
                                      prompt_text)
        self.speakers.store.put(speaker_id, prompt)

    def _params(self, model: str) -> dict[str, Any]:
        p = self.configs.params(model)
        self.threads[model] = int(p["torch_threads"])
        return p

    def vc_stream(self, model: str = "cosyvoice_vc_stream"):
        """:class:`~..serving.stages.vc_stream.VCStreamer` of ``model``."""
        from ..serving.stages.vc_stream import build_streamer

        return build_streamer(self._params(model), self.configs.graph, self.speakers.get)

    def vc_live(self, model: str = "cosyvoice_vc_live"):
        """:class:`~..serving.stages.live_vc.LiveVC` of ``model``."""
        from ..serving.stages.live_vc import build_live

        return build_live(self._params(model), self.configs.graph, self.speakers.get)

    def tts(self, model: str):
        """:class:`~..serving.stages.tts.TTSService` of ``model`` (``cosyvoice_tts_stream`` or
        ``cosyvoice_tts_live``: their parameters; :meth:`close` stops its LM engine)."""
        from ..serving.stages.tts import service_from_params
        from ..shapes import GRAPHS

        p = self._params(model)
        sfx = p["stage_suffix"]
        service = service_from_params(p, {g: self.configs.graph(g + sfx, g) for g in GRAPHS},
                                      speakers=self.speakers.get)
        self._closers.append(service.close)
        return service

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()
        self.configs.close()
