"""Warm a freshly loaded server up: one real request through every public pipeline, so that no client pays for
first calls (lazy allocations, onnxruntime / TensorRT first-run setup, the LM's first decode, Python imports on
first use).

Two mechanisms, because Triton's own one does not reach everything:

* Triton's ``model_warmup`` (rendered into the configs of the graphs, ``preprocess`` and ``postprocess``): runs
  sample requests inside the load, before the model is ready. It cannot serve an ensemble (Triton has no warm-up
  for ensembles) nor a BLS model (``flow``, ``hift``, the stream and TTS orchestrators, ``speakers``): their
  warm-up requests would call models that Triton may not have loaded yet (models load in parallel), and a failed
  warm-up fails the load.
* :func:`warm_up` (this module), once everything is loaded: for every loaded model whose inputs make it a public
  pipeline, one request over the protocol it serves (``cosyvoice_vc`` and its versions: a 1 s conversion;
  ``cosyvoice_tts``: a short sentence; the decoupled streams: one gRPC stream to its end; ``speakers``: a list;
  ``speech_tokens`` / ``speaker_embedding``: the tokens / embedding of the same 1 s sample; ``cosyvoice2``: the
  official runtime's request, over a gRPC stream when decoupled).
  These reach every member: the graphs, the BLS stages, the LM. The supervisor runs it after each (re)start and
  after each model reload; a failure is logged, never fatal (the model serves cold).

Strict readiness is already true while this runs (Triton knows nothing of it): the first requests of a rollout
may still meet a cold pipeline for the few seconds this takes. The supervisor writes ``<work dir>/warm`` when the
first warm-up is done; the Kubernetes ``startupProbe`` waits for that file (``deploy/k8s``), so a pod gets traffic
only once warm.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from ..marker import MARKER, read_marker
from ..samples import stage_warmup_samples

log = logging.getLogger(__name__)

__all__ = ["WARM_TEXT", "plan", "warm_up"]

WARM_TEXT = "Hello."


def loaded_models(server) -> list[dict]:
    """``[{name, inputs, outputs, decoupled}]`` of the loaded models (repository index and configs: admin APIs)."""
    status, body = server.request("POST", "/v2/repository/index", body=b"{}", admin=True, timeout=30)
    if status != 200:
        raise RuntimeError(f"repository index: HTTP {status} {body[:200]!r}")
    out = []
    for entry in json.loads(body):
        if entry.get("state") != "READY":
            continue
        status, body = server.request("GET", f"/v2/models/{entry['name']}/config", admin=True, timeout=30)
        if status != 200:
            continue
        cfg = json.loads(body)
        out.append({"name": cfg["name"], "inputs": {i["name"] for i in cfg.get("input", [])},
                    "outputs": {o["name"] for o in cfg.get("output", [])},
                    "decoupled": bool(cfg.get("model_transaction_policy", {}).get("decoupled", False)),
                    "sequence": "sequence_batching" in cfg})
    return out


def plan(models: list[dict]) -> list[tuple[str, str]]:
    """``(model, how)`` for the public pipelines among ``models``: how is ``vc``, ``vc_stream``, ``tts``,
    ``tts_stream``, ``speakers``, ``speech_tokens`` or ``speaker_embedding``: audio or text in and a waveform, the
    speech tokens or the speaker embedding out (not a stage such as ``preprocess``, which takes the audio but answers
    features, nor the graphs ``speech_tokenizer`` / ``speaker_encoder``, which take features); the stages and graphs
    are reached through them (or warmed by Triton)."""
    out = []
    for m in models:
        inputs, outputs = m["inputs"], m.get("outputs", set())
        if m.get("sequence"):  # a live model (sequence batcher) takes sequences only; its callees are warmed anyway
            continue
        if "action" in inputs and "speaker_id" in inputs:
            how = "speakers"
        elif "text" in inputs and "waveform" in outputs:
            how = "tts_stream" if m["decoupled"] else "tts"
        elif {"reference_wav", "target_text"} <= inputs and "waveform" in outputs:
            how = "official_stream" if m["decoupled"] else "official"
        elif {"source_audio", "prompt_audio"} <= inputs and "waveform" in outputs:
            how = "vc_stream" if m["decoupled"] else "vc"
        elif "source_audio" in inputs and outputs == {"speech_tokens"}:
            how = "speech_tokens"
        elif "prompt_audio" in inputs and outputs == {"speaker_embedding"}:
            how = "speaker_embedding"
        else:
            continue
        out.append((m["name"], how))
    return out


def _sample(server) -> tuple:
    tun = {}
    if (Path(server.model_repository) / MARKER).is_file():
        tun = read_marker(server.model_repository).get("tunables", {})
    seconds = min(max(1.0, float(tun.get("min_seconds", 1.0))), float(tun.get("max_seconds", 30.0)))
    s = stage_warmup_samples("preprocess", seconds)
    return s["source_audio"], int(s["source_sample_rate"][0])


def _official(server, name: str, audio, sr: int, *, stream: bool, timeout: float) -> None:
    """One request of the official runtime's ``cosyvoice2`` (16 kHz reference): a gRPC stream to its end, or
    one gRPC answer."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from ..stages.official_api import REFERENCE_SAMPLE_RATE, official_request

    if sr != REFERENCE_SAMPLE_RATE:
        raise ValueError(f"the warm-up sample is {sr} Hz, {name} takes {REFERENCE_SAMPLE_RATE} Hz")
    inputs = []
    for k, v in official_request(audio, WARM_TEXT, WARM_TEXT).items():
        inputs.append(grpcclient.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype)))
        inputs[-1].set_data_from_numpy(v)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if not stream:
            client.infer(name, inputs, client_timeout=timeout)
            return
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(name, inputs, enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=timeout)
            if error is not None:
                raise error
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream()
        client.close()


def warm_up(server, *, timeout: float = 600.0) -> dict[str, float | str]:
    """One request through every public pipeline of the running ``server`` (a
    :class:`~cosyvoice_triton.serving.launch.server.TritonServer`); returns model -> seconds it took, or the error."""
    from ...clients.client import CosyVoiceClient
    from ...clients.retry import NO_RETRY
    from ...clients.wire import SPEAKERS_MODELS

    family_of = {model: family for family, model in SPEAKERS_MODELS.items()}

    audio, sr = _sample(server)
    results: dict[str, float | str] = {}
    models = loaded_models(server)
    todo = plan(models)
    # a model without a seed input (cosyvoice3_vc: CosyVoice3's vocoder noise is fixed) is sent none
    seeds = {m["name"]: 0 if "seed" in m["inputs"] else None for m in models}
    # no retries: a warm-up that fails (a stage died meanwhile) is only logged; the next reload warms up again
    with CosyVoiceClient(server.http_url, protocol="http", timeout=timeout, concurrency=1, retry=NO_RETRY) as http, \
            CosyVoiceClient(server.grpc_url, protocol="grpc", timeout=timeout, retry=NO_RETRY) as grpc:
        for name, how in todo:
            t0 = time.perf_counter()
            try:
                if how == "vc":
                    http.model = name
                    http.convert(audio, audio, source_sr=sr, prompt_sr=sr, seed=seeds[name])
                elif how == "tts":
                    http.tts(WARM_TEXT, prompt=audio, prompt_sr=sr, seed=0, model=name)
                elif how == "vc_stream":
                    for _ in grpc.convert_stream(audio, audio, source_sr=sr, prompt_sr=sr, seed=seeds[name],
                                                 model=name):
                        pass
                elif how == "tts_stream":
                    for _ in grpc.tts_stream(WARM_TEXT, prompt=audio, prompt_sr=sr, seed=0, model=name):
                        pass
                elif how in ("official", "official_stream"):
                    _official(server, name, audio, sr, stream=how == "official_stream", timeout=timeout)
                elif how == "speech_tokens":
                    http.speech_tokens(audio, sample_rate=sr, model=name)
                elif how == "speaker_embedding":
                    http.speaker_embedding(audio, sample_rate=sr, model=name)
                else:  # a speakers model: of its family (a CosyVoice3 deployment has two)
                    grpc.list_speakers(family=family_of.get(name, "cosyvoice2"))
                results[name] = round(time.perf_counter() - t0, 3)
            except Exception as exc:  # a cold model still serves: say so and go on
                results[name] = f"{type(exc).__name__}: {exc}"
                log.warning("warm-up of %s (%s) failed: %s", name, how, exc)
    log.info("warm-up: %s", results)
    return results

