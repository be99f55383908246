"""``speakers``: register, get, list and delete speakers on the server (one process owns the store).

:class:`SpeakerService` answers one request of the ``speakers`` model (inputs and outputs: :data:`SPEAKER_INPUTS`,
:data:`SPEAKER_OUTPUTS`). ``register`` computes the prompt as :meth:`CosyVoice2.prompt
<cosyvoice_triton.pipeline.CosyVoice2.prompt>` does: the audio decoded / validated / resampled by the
:class:`~.frontend.Preprocessor`, its speech tokens and CAM++ embedding from the ``speech_tokenizer`` and
``speaker_encoder`` graphs (:data:`~.flow.GraphFn`, BLS in Triton), tokens and 24 kHz mel cut to a common length
(two mel frames per token), and the transcript normalised and tokenized by
:class:`~cosyvoice_triton.frontend.text.TextFrontend`
when given. The prompt is kept in a :class:`~cosyvoice_triton.speakers.SpeakerStore` (LRU, persisted folder, ids
validated, thread-safe). Every refusal is a :class:`~cosyvoice_triton.errors.CosyVoiceError` naming the input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import SpeakerError
from ...family import COSYVOICE2, COSYVOICE3
from ...prompt_cache import PromptCache, prompt_key
from ...shapes import TensorSpec
from ...speakers import SpeakerPrompt, SpeakerStore, validate_speaker_id
from .batching import RequestError
from .flow import GraphFn
from .frontend import Preprocessor

__all__ = ["ACTIONS", "SPEAKER_INPUTS", "SPEAKER_OUTPUTS", "BlsSpeakers", "SpeakerService", "build_service",
           "build_service3", "bytes_scalar", "compute_prompt", "prompt_tensors"]

ACTIONS = ("register", "get", "list", "delete")
_B = "batch"
#: Inputs of the ``speakers`` model (batch 1 per request); all but ``action`` optional.
SPEAKER_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("action", "bytes", (_B, 1)),
    TensorSpec("speaker_id", "bytes", (_B, 1)),
    TensorSpec("prompt_audio", "float32", (_B, "prompt_samples")),
    TensorSpec("prompt_sample_rate", "int32", (_B, 1)),
    TensorSpec("prompt_audio_bytes", "bytes", (_B, 1)),
    TensorSpec("prompt_text", "bytes", (_B, 1)),
)
#: Outputs: ``speaker_ids`` always (the list, or the id acted on); the prompt for ``get`` and ``register``.
SPEAKER_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("speaker_ids", "bytes", (_B, "speakers")),
    TensorSpec("prompt_tokens", "int32", (_B, "prompt_tokens")),
    TensorSpec("prompt_mel", "float32", (_B, "prompt_mel_frames", 80)),
    TensorSpec("embedding", "float32", (_B, 192)),
    TensorSpec("prompt_text_tokens", "int32", (_B, "prompt_text_tokens")),
    TensorSpec("prompt_text", "bytes", (_B, 1)),
)


def bytes_scalar(value, name: str) -> str:
    """The one UTF-8 string of a ``[1]`` BYTES tensor."""
    arr = np.asarray(value, dtype=object).reshape(-1)
    if arr.size != 1:
        raise RequestError(f"{name}: expected one value, got {arr.size}")
    item = arr[0]
    if isinstance(item, (bytes, bytearray)):
        try:
            return bytes(item).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name}: not valid UTF-8") from None
    return str(item)


def compute_prompt(pre: Preprocessor, graphs: Mapping[str, GraphFn], audio: tuple, *, token_mel_ratio: int,
                   prompt_text: str | None = None, prompt_text_tokens=None, family: str = COSYVOICE2) -> SpeakerPrompt:
    """``CosyVoice2.prompt`` with the graphs: ``audio`` = (samples, sample rate, encoded bytes) as the request
    gives them; the speech tokens (``speech_tokenizer``), the CAM++ embedding (``speaker_encoder``), the 24 kHz
    mel cut with the tokens to 2 frames per token, and the transcript with its (already computed) text tokens.
    With ``pre.prompt_cache``, a recording seen before (same samples, rate and ``pre.options``) skips the front
    end and both graphs. ``family``: the model family of the graphs (the prompt is marked with it)."""
    wave, sr = pre.utterance("prompt", *audio)

    def compute() -> dict[str, np.ndarray]:
        whisper, fbank, mel = pre.prompt_features(wave, sr)
        tokens = graphs["speech_tokenizer"]({"whisper_mel": whisper[None],
                                             "whisper_mel_len": np.array([whisper.shape[1]], np.int32)})
        embedding = graphs["speaker_encoder"]({"fbank": np.ascontiguousarray(fbank[None], dtype=np.float32)})
        return {"prompt_tokens": np.asarray(tokens["speech_tokens"], np.int32).reshape(-1), "prompt_mel": mel,
                "embedding": np.asarray(embedding["speaker_embedding"], np.float32).reshape(-1)}

    if pre.prompt_cache is None:
        entry = compute()
    else:
        key = prompt_key(wave, sr, kind="prompt_tokens", options=pre.options)
        entry = pre.prompt_cache.get_or_compute(key, compute)
    tokens, mel = entry["prompt_tokens"], entry["prompt_mel"]
    n = min(mel.shape[0] // token_mel_ratio, tokens.size)
    if n < 1:
        raise RequestError("prompt_audio: too short for one speech token")
    text_tokens = np.zeros(0, np.int32) if prompt_text_tokens is None else np.asarray(prompt_text_tokens, np.int32)
    return SpeakerPrompt(prompt_tokens=tokens[:n], prompt_mel=np.ascontiguousarray(mel[: token_mel_ratio * n]),
                         embedding=entry["embedding"],
                         prompt_text_tokens=text_tokens, prompt_text="" if prompt_text is None else prompt_text,
                         family=family)


def prompt_tensors(prompt: SpeakerPrompt) -> dict[str, np.ndarray]:
    """The ``get`` outputs of a prompt."""
    return {"prompt_tokens": np.array(prompt.prompt_tokens, np.int32),
            "prompt_mel": np.array(prompt.prompt_mel, np.float32),
            "embedding": np.array(prompt.embedding, np.float32),
            "prompt_text_tokens": np.array(prompt.prompt_text_tokens, np.int32),
            "prompt_text": np.array([prompt.prompt_text.encode("utf-8")], dtype=object)}


class SpeakerService:
    """The ``speakers`` model's work.

    Args:
        store: where the prompts live.
        pre: decodes, validates and resamples the prompt audio and computes its features.
        graphs: ``speech_tokenizer`` and ``speaker_encoder`` callables.
        text_frontend: ``() -> TextFrontend`` (built on first use; ``None``: registration with a transcript is
            refused, the model folder has no text front end).
        token_mel_ratio: mel frames per speech token (2).
        family: the model family whose prompts this store holds (speakers of another family are refused).
        transcript: the transcript as the family's LM reads it (CosyVoice3: the system prompt and
            ``<|endofprompt|>`` in front, :func:`~cosyvoice_triton.frontend.text.cosyvoice3.zero_shot_prompt_text`,
            unless it already holds them); kept and tokenized in that form.
    """

    def __init__(self, store: SpeakerStore, pre: Preprocessor, graphs: Mapping[str, GraphFn], *,
                 text_frontend: Callable[[], Any] | None = None, token_mel_ratio: int = 2,
                 family: str = COSYVOICE2, transcript: Callable[[str], str] = str):
        self.store, self.pre, self.graphs = store, pre, graphs
        self._text_factory, self._text = text_frontend, None
        self.ratio = int(token_mel_ratio)
        self.family, self.transcript = family, transcript

    def text(self):
        if self._text is None:
            if self._text_factory is None:
                raise RequestError("prompt_text: this server has no text front end (CosyVoice-BlankEN/ missing in "
                                   "the model folder); register without a transcript")
            self._text = self._text_factory()
        return self._text

    def prompt(self, prompt_audio=None, prompt_sample_rate=None, prompt_audio_bytes=None,
               prompt_text: str | None = None) -> SpeakerPrompt:
        """The prompt of a recording (and its transcript), as the family's ``prompt`` (``CosyVoice2.prompt``,
        ``CosyVoice3.prompt``) computes it."""
        if prompt_text is not None:
            prompt_text = self.transcript(prompt_text)
        text_tokens = None if prompt_text is None else self.text().prompt_tokens(prompt_text)
        return compute_prompt(self.pre, self.graphs, (prompt_audio, prompt_sample_rate, prompt_audio_bytes),
                              token_mel_ratio=self.ratio, prompt_text=prompt_text, prompt_text_tokens=text_tokens,
                              family=self.family)

    def get(self, speaker_id: str) -> SpeakerPrompt:
        """A speaker for synthesis: one registered with a model of the served family, else SpeakerError."""
        return self.store.get(speaker_id, family=self.family)

    def handle(self, tensors: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """One request's outputs; raises :class:`~cosyvoice_triton.errors.CosyVoiceError` for bad input."""
        if tensors.get("action") is None:
            raise RequestError(f"missing input 'action' (one of {', '.join(ACTIONS)})")
        action = bytes_scalar(tensors["action"], "action").strip().lower()
        if action not in ACTIONS:
            raise RequestError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
        if action == "list":
            return {"speaker_ids": _ids(self.store.list())}
        if tensors.get("speaker_id") is None:
            raise RequestError(f"action {action} needs input 'speaker_id'")
        speaker_id = validate_speaker_id(bytes_scalar(tensors["speaker_id"], "speaker_id"))
        if action == "get":
            return {"speaker_ids": _ids([speaker_id]), **prompt_tensors(self.get(speaker_id))}
        if action == "delete":
            self.store.delete(speaker_id)
            return {"speaker_ids": _ids([speaker_id])}
        text = tensors.get("prompt_text")
        text = None if text is None else bytes_scalar(text, "prompt_text")
        if text is not None and not text.strip():
            raise SpeakerError("prompt_text: empty transcript (leave the input out for a speaker without one)")
        prompt = self.prompt(tensors.get("prompt_audio"), tensors.get("prompt_sample_rate"),
                             tensors.get("prompt_audio_bytes"), text)
        self.store.put(speaker_id, prompt)
        return {"speaker_ids": _ids([speaker_id]), **prompt_tensors(prompt)}


def _ids(ids) -> np.ndarray:
    return np.array([i.encode("utf-8") for i in ids], dtype=object)


#: The text front end's tokenizer folder inside a CosyVoice2 model folder.
TEXT_DIR = "CosyVoice-BlankEN"


def build_service(params: Mapping[str, Any], graph_fn: Callable[[str, str], GraphFn]) -> SpeakerService:
    """The service of a ``speakers`` model from its config parameters (``MODEL_PARAMS["speakers"]``);
    ``graph_fn(model, graph)``: a callable of the Triton model ``model`` serving graph ``graph`` (CosyVoice2; a
    CosyVoice3 folder's graphs run in process: :func:`build_service3`). A relative ``speaker_dir`` is under the
    server's working directory."""
    from pathlib import Path

    from ...config import ModelConfig

    if params.get("family", COSYVOICE2) == COSYVOICE3:
        return build_service3(params)
    model_dir = Path(params["model_dir"])
    config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
    graph_models = (params["tokenizer_model"], params["speaker_encoder_model"])
    pre = Preprocessor(config.mel, sample_rate=config.sample_rate, min_seconds=params["min_seconds"],
                       max_seconds=params["max_seconds"],
                       prompt_cache=PromptCache.from_params(params["prompt_cache_entries"], params["prompt_cache_mb"]),
                       model_id=f"{model_dir.resolve()}|{'|'.join(graph_models)}")
    store = SpeakerStore(Path(params["speaker_dir"]).resolve(), capacity=params["capacity"])
    text = None
    if (model_dir / TEXT_DIR).is_dir():
        def text():
            from ...frontend.text import TextFrontend

            return TextFrontend(model_dir / TEXT_DIR)
    graphs = {"speech_tokenizer": graph_fn(graph_models[0], "speech_tokenizer"),
              "speaker_encoder": graph_fn(graph_models[1], "speaker_encoder")}
    return SpeakerService(store, pre, graphs, text_frontend=text, token_mel_ratio=config.token_mel_ratio)


#: How the speakers model's answers start when the id is not the reason: its own fault, or Triton's about the model
#: (dead, unloaded, not ready). A BLS answer from a decoupled caller's thread does not always keep the code
#: (INVALID_ARG came back as another); the speakers model's other refusals are about the id it was sent.
_NOT_THE_ID = ("internal error: ", "Stub process", "Failed for execute", "Request for unknown model")


class BlsSpeakers:
    """``speaker_id -> SpeakerPrompt`` by a BLS ``get`` to the ``speakers`` model of ``family`` (``pb``:
    ``triton_python_backend_utils``). An unknown or bad id comes back as the model's INVALID_ARG, raised as a
    :class:`~cosyvoice_triton.errors.SpeakerError` with its message."""

    def __init__(self, pb, model: str = "speakers", *, timeout_us: int = 0, family: str = COSYVOICE2):
        self.pb, self.model, self.timeout_us, self.family = pb, model, int(timeout_us), family

    def __call__(self, speaker_id: str) -> SpeakerPrompt:
        pb = self.pb
        inputs = [pb.Tensor("action", np.array([[b"get"]], dtype=object)),
                  pb.Tensor("speaker_id", np.array([[speaker_id.encode("utf-8")]], dtype=object))]
        kwargs = {"timeout": self.timeout_us} if self.timeout_us else {}
        names = [t.name for t in SPEAKER_OUTPUTS[1:]]
        res = pb.InferenceRequest(model_name=self.model, inputs=inputs, requested_output_names=names,
                                  **kwargs).exec()
        if res.has_error():
            err = res.error()
            message = err.message()
            invalid = hasattr(err, "code") and err.code() == pb.TritonError.INVALID_ARG
            if invalid or not message.startswith(_NOT_THE_ID):
                raise SpeakerError(message)
            raise RuntimeError(f"{self.model}: {message}")
        out = {n: pb.get_output_tensor_by_name(res, n).as_numpy()[0] for n in names}
        return SpeakerPrompt(prompt_tokens=out["prompt_tokens"].astype(np.int32),
                             prompt_mel=out["prompt_mel"].astype(np.float32),
                             embedding=out["embedding"].astype(np.float32),
                             prompt_text_tokens=out["prompt_text_tokens"].astype(np.int32),
                             prompt_text=bytes_scalar(out["prompt_text"], "prompt_text"), family=self.family)


def build_service3(params: Mapping[str, Any]) -> SpeakerService:
    """The service of a CosyVoice3 ``speakers`` model (``cosyvoice3_speakers``): the folder's
    ``speech_tokenizer_v3.onnx`` and ``campplus.onnx`` in process, its mel settings and text front end; a
    transcript gets the system prompt in front as the official zero-shot examples write it."""
    from pathlib import Path

    from ...frontend.speech_models import SpeakerEncoder, SpeechTokenizer
    from ...frontend.text.cosyvoice3 import with_system_prompt
    from ...models.cosyvoice3.config import read_cosyvoice3_yaml
    from ...models.cosyvoice3.pipeline import SPEECH_TOKENIZER

    model_dir = Path(params["model_dir"])
    config = read_cosyvoice3_yaml(model_dir)
    tokenizer = SpeechTokenizer(model_dir / SPEECH_TOKENIZER, version="v3")
    encoder = SpeakerEncoder(model_dir / "campplus.onnx")
    pre = Preprocessor(config.mel, sample_rate=config.sample_rate, min_seconds=params["min_seconds"],
                       max_seconds=params["max_seconds"],
                       prompt_cache=PromptCache.from_params(params["prompt_cache_entries"], params["prompt_cache_mb"]),
                       model_id=f"{model_dir.resolve()}|{SPEECH_TOKENIZER}|campplus.onnx")
    graphs = {"speech_tokenizer": lambda t: {"speech_tokens": tokenizer.tokenize(t["whisper_mel"],
                                                                                 t["whisper_mel_len"])[0]},
              "speaker_encoder": lambda t: {"speaker_embedding": encoder.embed(t["fbank"])}}

    def text():
        from ...frontend.text import TextFrontend
        from ...models.llm import QWEN_DIR

        return TextFrontend(model_dir / QWEN_DIR, family=COSYVOICE3)

    store = SpeakerStore(Path(params["speaker_dir"]).resolve(), capacity=params["capacity"])
    return SpeakerService(store, pre, graphs, text_frontend=text, token_mel_ratio=config.flow.token_mel_ratio,
                          family=COSYVOICE3, transcript=lambda t: with_system_prompt("zero_shot", "", t, None)[1])
