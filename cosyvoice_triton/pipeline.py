"""In-process CosyVoice2 voice conversion: the official VC path, as one object.

``CosyVoice2.from_pretrained(model_dir)`` loads an official model folder (``cosyvoice2.yaml``, ``flow.pt``,
``hift.pt``, ``speech_tokenizer_v2.onnx``, ``campplus.onnx``). :meth:`CosyVoice2.convert` then does what
``CosyVoice2.inference_vc`` does: speech tokens of source and prompt (Whisper log-mel + tokenizer at
16 kHz), the prompt's 24 kHz mel and CAM++ speaker embedding, the flow, HiFT. This is the reference the
served pipeline is checked against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import audio, features
from .checkpoint import check_flow_revision, load_into, normalize_keys, read_state_dict
from .config import ModelConfig
from .errors import CheckpointError
from .models.flow import CausalMaskedDiffWithXvec
from .models.hift import HiFTGenerator
from .speech_models import SpeakerEncoder, SpeechTokenizer

log = logging.getLogger(__name__)

MODEL_FILES = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx")


@dataclass
class StageTimer:
    """Wall-clock seconds per named stage, summed over calls (``timer.seconds["flow.encoder"]``)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


_NO_TIMER = StageTimer()


@dataclass
class VCInputs:
    """What the official ``frontend_vc`` hands to the model, for one utterance pair (numpy, no batch axis).

    source_tokens [Ts] int32 and prompt_tokens [Tp] int32 (25 Hz), prompt_mel [Tf, 80] float32 (50 Hz,
    24 kHz CosyVoice mel), embedding [192] float32 (CAM++ of the prompt).
    """

    source_tokens: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    embedding: np.ndarray


class CosyVoice2:
    """The VC models of one CosyVoice2 folder on one torch device (CPU by default)."""

    # streaming constants of the official CosyVoice2Model
    TOKEN_HOP = 25
    TOKEN_MAX_HOP = 100
    STREAM_SCALE = 2
    MEL_CACHE = 8

    def __init__(self, config: ModelConfig, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator,
                 tokenizer: SpeechTokenizer, speaker: SpeakerEncoder, *, device: str | torch.device = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.flow = flow.to(self.device).eval()
        self.hift = hift.to(self.device).eval()
        self.tokenizer = tokenizer
        self.speaker = speaker
        self.source_cache = self.MEL_CACHE * config.hift.upsample_factor
        self.fade_window = np.hamming(2 * self.source_cache)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str | torch.device = "cpu",
                        onnx_threads: int = 1) -> CosyVoice2:
        """Load an official CosyVoice2 model folder (or a demo folder of the same layout)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model folder not found")
        missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: missing {', '.join(missing)} (a CosyVoice2 folder has "
                                  f"{', '.join(MODEL_FILES)})")
        config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")

        path = model_dir / "flow.pt"
        state = normalize_keys(read_state_dict(path))
        check_flow_revision(state, path)
        flow = CausalMaskedDiffWithXvec(config.flow)
        load_into(flow, state, path)

        path = model_dir / "hift.pt"
        hift = HiFTGenerator(config.hift)
        load_into(hift, normalize_keys(read_state_dict(path)), path)
        hift.fold_weight_norm()

        tokenizer = SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx", intra_op_threads=onnx_threads)
        speaker = SpeakerEncoder(model_dir / "campplus.onnx", intra_op_threads=onnx_threads)
        features.mel_basis(config.mel)  # build the filter banks (and librosa's lazy imports) now, not per call
        features.whisper_mel_filters(128)
        return cls(config, flow, hift, tokenizer, speaker, device=device)

    # ------------------------------------------------------------------------------------- front end

    def frontend_vc(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                    timer: StageTimer = _NO_TIMER) -> VCInputs:
        """Official ``frontend_vc``. ``source``/``prompt``: a path, encoded bytes, or samples with ``*_sr``."""
        with timer.stage("frontend"):
            src16 = audio.load_audio(source, target_sr=audio.TOKENIZER_SR, sample_rate=source_sr, name="source")
            # the prompt is needed at two rates: decode and validate it once
            prompt, prompt_sr = audio.decode_if_encoded(prompt, prompt_sr, name="prompt")
            prompt = audio.validate_audio(prompt, sample_rate=prompt_sr, name="prompt")
            p16 = audio.resample(prompt, orig_sr=prompt_sr, target_sr=audio.TOKENIZER_SR)
            p24 = audio.resample(prompt, orig_sr=prompt_sr, target_sr=self.config.sample_rate)
            whisper, whisper_len = features.whisper_log_mel_batch([src16, p16])
            fbank, fbank_len = features.kaldi_fbank_batch([p16])
            prompt_mel = features.cosyvoice_mel(p24, sample_rate=self.config.sample_rate, config=self.config.mel)
        with timer.stage("tokenizer"):
            source_tokens, prompt_tokens = self.tokenizer.tokenize(whisper, whisper_len)
        with timer.stage("speaker_embedding"):
            embedding = self.speaker.embed(fbank, fbank_len)[0]
        return VCInputs(source_tokens=source_tokens, prompt_tokens=prompt_tokens, prompt_mel=prompt_mel,
                        embedding=embedding)

    # ---------------------------------------------------------------------------------- token to wav

    def _tensors(self, inputs: VCInputs, tokens: np.ndarray) -> tuple[torch.Tensor, ...]:
        dev = self.device
        return (torch.as_tensor(tokens, dtype=torch.int32, device=dev)[None],
                torch.as_tensor(inputs.prompt_tokens, dtype=torch.int32, device=dev)[None],
                torch.as_tensor(inputs.prompt_mel, dtype=torch.float32, device=dev)[None],
                torch.as_tensor(inputs.embedding, dtype=torch.float32, device=dev)[None])

    @torch.inference_mode()
    def _flow(self, inputs: VCInputs, tokens: np.ndarray, *, streaming: bool, finalize: bool,
              timer: StageTimer) -> torch.Tensor:
        with timer.stage("flow.encoder"):
            c = self.flow.condition(*self._tensors(inputs, tokens), streaming=streaming, finalize=finalize)
        with timer.stage("flow.solver"):
            mel = self.flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming)
        mel, _ = c.crop(mel)
        return mel  # [1, 80, T]

    @torch.inference_mode()
    def _hift(self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: torch.Tensor | None,
              generator: torch.Generator | None, timer: StageTimer) -> tuple[torch.Tensor, torch.Tensor]:
        with timer.stage("hift"):
            if noise is not None:
                noise = torch.as_tensor(noise, dtype=torch.float32, device=self.device)
            return self.hift.inference(mel, cache_source=cache_source, noise_sine=noise, generator=generator)

    def token2wav(self, inputs: VCInputs, *, seed: int | None = 0, hift_noise: np.ndarray | None = None,
                  timer: StageTimer = _NO_TIMER) -> np.ndarray:
        """Non-streaming token-to-waveform (official ``token2wav(finalize=True)``): float32 [N] at 24 kHz.

        HiFT's NSF noise comes from ``hift_noise`` [1, 480 T, 9] when given, else from a generator seeded
        with ``seed`` (which replays what ``torch.manual_seed(seed)`` gives the official code on CPU), else
        from torch's global RNG (``seed=None``).
        """
        mel = self._flow(inputs, inputs.source_tokens, streaming=False, finalize=True, timer=timer)
        speech, _ = self._hift(mel, None, hift_noise, _generator(seed), timer)
        return speech[0].float().cpu().numpy()

    def token2wav_stream(self, inputs: VCInputs, *, seed: int | None = 0,
                         hift_noise: Sequence[np.ndarray] | None = None,
                         timer: StageTimer = _NO_TIMER) -> Iterator[np.ndarray]:
        """Official streaming ``tts(stream=True)`` for VC: yields float32 chunks at 24 kHz.

        Chunks of 25, 50, then 100 tokens (the first padded so that prompt + chunk is a multiple of 25),
        each run with chunk-causal attention and 3 look-ahead tokens; HiFT keeps 8 mel frames and 3840
        source samples of context and crossfades 3840 samples with a Hamming window. The hop schedule
        restarts for every call (the official instance keeps doubling across requests; the official
        references use a fresh instance, as here). ``hift_noise``: one array per HiFT call, in order.
        """
        ends = self.stream_chunk_ends(len(inputs.source_tokens), len(inputs.prompt_tokens))
        if hift_noise is not None and len(hift_noise) <= len(ends):
            raise ValueError(f"hift_noise: {len(hift_noise)} arrays for a stream of {len(ends) + 1} HiFT calls; "
                             "pass one per chunk")
        yield from self.tokens2wav_stream(inputs, inputs.source_tokens.tolist(), seed=seed, hift_noise=hift_noise,
                                          timer=timer)

    def tokens2wav_stream(self, inputs: VCInputs, tokens: Iterable[int], *, seed: int | None = 0,
                          hift_noise: Sequence[np.ndarray] | None = None,
                          timer: StageTimer = _NO_TIMER) -> Iterator[np.ndarray]:
        """:meth:`token2wav_stream` over speech tokens that arrive one by one (the LM's, in streaming TTS).

        A chunk runs as soon as its hop plus the look-ahead tokens have arrived, so the chunks are those of
        :meth:`stream_chunk_ends` for the final token count, whatever the arrival times; the last chunk runs
        when ``tokens`` is exhausted. ``inputs.source_tokens`` is ignored.
        """
        la, ratio = self.flow.pre_lookahead_len, self.flow.token_mel_ratio
        generator = _generator(seed)
        noises = iter(hift_noise) if hift_noise is not None else None
        pad = -len(inputs.prompt_tokens) % self.TOKEN_HOP  # the first chunk only
        hop, offset, cache, got = self.TOKEN_HOP, 0, None, []
        for token in tokens:
            got.append(int(token))
            if len(got) - offset < hop + pad + la:
                continue
            end = offset + hop + pad
            mel = self._flow(inputs, np.asarray(got[: end + la], dtype=np.int32), streaming=True, finalize=False,
                             timer=timer)[:, :, offset * ratio:]
            speech, cache = self._hift_chunk(mel, cache, _next_noise(noises), generator, timer, final=False)
            offset, hop, pad = end, min(self.TOKEN_MAX_HOP, hop * self.STREAM_SCALE), 0
            yield speech
        if not got:
            raise ValueError("no speech tokens to synthesise")
        mel = self._flow(inputs, np.asarray(got, dtype=np.int32), streaming=False, finalize=True,
                         timer=timer)[:, :, offset * ratio:]
        speech, _ = self._hift_chunk(mel, cache, _next_noise(noises), generator, timer, final=True)
        yield speech

    def stream_chunk_ends(self, n_tokens: int, n_prompt_tokens: int) -> list[int]:
        """Where the non-final chunks of :meth:`token2wav_stream` end, in source tokens.

        The official schedule: hops of 25, 50, then 100 tokens, the first one longer by the padding that makes
        prompt + chunk a multiple of 25; a chunk is only run while its hop plus the look-ahead tokens are
        available. The final chunk, from the last end to ``n_tokens``, is not listed.
        """
        la = self.flow.pre_lookahead_len
        pad = -n_prompt_tokens % self.TOKEN_HOP  # ceil(n_prompt / 25) * 25 - n_prompt, first chunk only
        hop, offset, ends = self.TOKEN_HOP, 0, []
        while n_tokens - offset >= hop + pad + la:
            offset += hop + pad
            ends.append(offset)
            hop, pad = min(self.TOKEN_MAX_HOP, hop * self.STREAM_SCALE), 0
        return ends

    def _hift_chunk(self, mel: torch.Tensor, cache: dict | None, noise: np.ndarray | None,
                    generator: torch.Generator | None, timer: StageTimer, *, final: bool):
        cache_source = None
        if cache is not None:
            mel = torch.cat([cache["mel"], mel], dim=2)
            cache_source = cache["source"]
        speech, source = self._hift(mel, cache_source, noise, generator, timer)
        speech = speech[0].double().cpu().numpy()
        if cache is not None:  # crossfade with the held-back tail of the previous chunk, as the official
            n = self.source_cache
            speech[:n] = speech[:n] * self.fade_window[:n] + cache["speech"] * self.fade_window[n:]
        new_cache = None
        if not final:
            new_cache = {"mel": mel[:, :, -self.MEL_CACHE:], "source": source[:, :, -self.source_cache:],
                         "speech": speech[-self.source_cache:]}
            speech = speech[: -self.source_cache]
        return speech.astype(np.float32), new_cache

    # ------------------------------------------------------------------------------------ end to end

    def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                stream: bool = False, seed: int | None = 0, timer: StageTimer = _NO_TIMER) -> np.ndarray:
        """Voice conversion: speak the content of ``source`` in the voice of ``prompt``.

        Returns float32 [N] at ``config.sample_rate`` (24 kHz). Streaming mode concatenates its chunks.
        Bad audio raises :class:`~cosyvoice_triton.errors.AudioError`.
        """
        inputs = self.frontend_vc(source, prompt, source_sr=source_sr, prompt_sr=prompt_sr, timer=timer)
        if stream:
            return np.concatenate(list(self.token2wav_stream(inputs, seed=seed, timer=timer)))
        return self.token2wav(inputs, seed=seed, timer=timer)


def _next_noise(noises: Iterator[np.ndarray] | None) -> np.ndarray | None:
    if noises is None:
        return None
    try:
        return next(noises)
    except StopIteration:
        raise ValueError("hift_noise: fewer arrays than HiFT calls in the stream; pass one per chunk") from None


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(int(seed))
