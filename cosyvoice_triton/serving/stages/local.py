"""The ``cosyvoice_vc`` ensemble, in-process: the same stages, batching and graphs, without a server.

:class:`LocalPipeline` wires :class:`~.frontend.Preprocessor`, six :class:`~.graphs.GraphRunner` s,
:class:`~.flow.FlowSolver`, :class:`~.vocoder.HiftRunner` and :class:`~.postprocess.Postprocessor` exactly as
the ensemble and the BLS models do, for a batch of requests. The served output equals
:meth:`LocalPipeline.convert_batch` (up to float rounding between batch sizes), which is checked against
``CosyVoice2.convert`` in ``tests/unit/test_serving_stages.py``; the live server is checked against both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ...config import ModelConfig
from ...shapes import GRAPHS
from .batching import ItemResult
from .flow import FlowItem, FlowSolver
from .frontend import Preprocessor
from .graphs import GraphRunner
from .postprocess import Postprocessor
from .vocoder import HiftRunner

__all__ = ["LocalPipeline"]


class LocalPipeline:
    def __init__(self, model_dir: str | Path, onnx_dir: str | Path, *, intra_op_threads: int = 1,
                 postprocessor: Postprocessor | None = None, n_timesteps: int | None = None):
        self.config = ModelConfig.from_yaml(Path(model_dir) / "cosyvoice2.yaml")
        self.pre = Preprocessor(self.config.mel, sample_rate=self.config.sample_rate)
        self.graphs = {name: GraphRunner(name, onnx_path=Path(onnx_dir) / f"{name}.onnx",
                                         intra_op_threads=intra_op_threads) for name in GRAPHS}
        self.flow = FlowSolver(self.config.flow.cfm, token_mel_ratio=self.config.token_mel_ratio,
                               n_timesteps=n_timesteps)
        self.hift = HiftRunner()
        self.post = postprocessor or Postprocessor(model_sample_rate=self.config.sample_rate)

    def _graph_fn(self, name: str):
        return self.graphs[name].run

    def convert_batch(self, requests: Sequence[Mapping[str, np.ndarray]], seeds: Sequence[int] | None = None
                      ) -> list[ItemResult[np.ndarray]]:
        """Each request: the ``cosyvoice_vc`` input tensors (batch 1). Returns the served waveform per request."""
        seeds = list(seeds) if seeds is not None else [0] * len(requests)
        front = self.pre.batch(requests)
        ok = [i for i, r in enumerate(front) if r.ok]
        results: list[ItemResult] = [r if not r.ok else ItemResult() for r in front]

        def fail(idx, res):
            for i, r in zip(idx, res, strict=True):
                if not r.ok:
                    results[i] = r
            return [i for i, r in zip(idx, res, strict=True) if r.ok], [r.value for i, r in zip(idx, res, strict=True)
                                                                        if r.ok]

        feats = [front[i].value.tensors() for i in ok]
        tok = self.graphs["speech_tokenizer"]
        src = tok.run_items([{"whisper_mel": f["source_whisper_mel"],
                              "whisper_mel_len": f["source_whisper_mel_len"].reshape(-1)} for f in feats])
        prm = tok.run_items([{"whisper_mel": f["prompt_whisper_mel"],
                              "whisper_mel_len": f["prompt_whisper_mel_len"].reshape(-1)} for f in feats])
        spk = self.graphs["speaker_encoder"].run_items([{"fbank": f["prompt_fbank"]} for f in feats])
        items, idx = [], []
        for j, i in enumerate(ok):
            for r in (src[j], prm[j], spk[j]):
                if not r.ok:
                    results[i] = r
                    break
            else:
                items.append(FlowItem.from_tensors({
                    "source_speech_tokens": src[j].value["speech_tokens"],
                    "prompt_speech_tokens": prm[j].value["speech_tokens"],
                    "prompt_mel": feats[j]["prompt_mel"], "speaker_embedding": spk[j].value["speaker_embedding"]}))
                idx.append(i)
        mels = self.flow.run(items, self._graph_fn("flow_encoder"), self._graph_fn("flow_estimator"))
        idx, mel_values = fail(idx, mels)
        waves = self.hift.run(mel_values, [seeds[i] for i in idx], self._graph_fn("hift_source"),
                              self._graph_fn("hift_decoder"))
        idx, wave_values = fail(idx, waves)
        for i, w in zip(idx, wave_values, strict=True):
            results[i] = ItemResult(self.post.waveform(w))
        return results

    def convert(self, source: np.ndarray, source_sr: int, prompt: np.ndarray, prompt_sr: int, *, seed: int = 0
                ) -> np.ndarray:
        """One request; raises its error."""
        req = {"source_audio": np.asarray(source, np.float32)[None],
               "source_sample_rate": np.array([[source_sr]], np.int32),
               "prompt_audio": np.asarray(prompt, np.float32)[None],
               "prompt_sample_rate": np.array([[prompt_sr]], np.int32)}
        return self.convert_batch([req], [seed])[0].unwrap()
