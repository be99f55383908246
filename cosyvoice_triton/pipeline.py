"""In-process CosyVoice2: the official voice-conversion and text-to-speech paths, as one object.

``CosyVoice2.from_pretrained(model_dir)`` loads an official model folder (``cosyvoice2.yaml``, ``flow.pt``,
``hift.pt``, ``speech_tokenizer_v2.onnx``, ``campplus.onnx``; for TTS also ``llm.pt`` and ``CosyVoice-BlankEN/``).
:meth:`CosyVoice2.convert` does what ``CosyVoice2.inference_vc`` does: speech tokens of source and prompt
(Whisper log-mel + tokenizer at 16 kHz), the prompt's 24 kHz mel and CAM++ speaker embedding, the flow, HiFT.
:meth:`CosyVoice2.tts` does what ``inference_zero_shot`` / ``inference_cross_lingual`` / ``inference_instruct2``
do: text front end, the LM (speech tokens), then the same token-to-wav path. This is the reference the served
pipeline is checked against.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import longform
from .config import ModelConfig
from .errors import CheckpointError, ConfigError, CosyVoiceError, LLMError, TextError
from .family import COSYVOICE2
from .frontend import audio, features
from .frontend.speech_models import SpeakerEncoder, SpeechTokenizer
from .models.checkpoint import load_flow, load_into, normalize_keys, read_state_dict
from .models.flow import CausalMaskedDiffWithXvec
from .models.hift import HiFTGenerator
from .models.incremental import DEFAULT_MAX_CACHE_BYTES, FlowStreamState, incremental_chunk
from .models.speed import check_speed, stretch_mel
from .prompt_cache import CacheEntry, PromptCache
from .prompt_frontend import _NO_TIMER, PromptFrontend, StageTimer, VCInputs, prompt_options
from .speaker_state import SpeakerState
from .speakers import SpeakerPrompt, SpeakerStore
from .streaming import MEL_CACHE, StreamSchedule, stream_chunk_ends, stream_chunks
from .threads import ThreadChoice, configure

log = logging.getLogger(__name__)

MODEL_FILES = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v2.onnx", "campplus.onnx")
TTS_FILES = ("llm.pt", "CosyVoice-BlankEN/config.json")
TTS_MODES = ("zero_shot", "cross_lingual", "instruct")


class CosyVoice2(PromptFrontend):
    """The models of one CosyVoice2 folder on one torch device (CPU by default); ``llm`` and ``text`` are
    ``None`` for a folder without the TTS files (voice conversion only).

    ``prompt_cache``: a repeated prompt recording (same samples and rate) reuses its speech tokens, mel and
    embedding from this :class:`~.prompt_cache.PromptCache` (``None``: computed every time). Entries are keyed
    by the audio and by the identity of the tokenizer / CAM++ files and the mel settings, so one cache may be
    shared between models.

    ``speaker_state``: for a registered speaker (``speaker_id``), the LM prefix of its transcript and, in
    streaming, the flow's settled prompt frames are computed once and reused from this
    :class:`~.speaker_state.SpeakerState` (``None``: computed for every request); it follows :attr:`speakers`,
    so a deleted or replaced speaker's entries go with it."""

    family = COSYVOICE2

    def __init__(self, config: ModelConfig, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator,
                 tokenizer: SpeechTokenizer, speaker: SpeakerEncoder, *, device: str | torch.device = "cpu",
                 llm=None, text=None, speakers: SpeakerStore | None = None,
                 prompt_cache: PromptCache | None = None, speaker_state: SpeakerState | bool = True):
        self.config = config
        self.device = torch.device(device)
        self.flow = flow.to(self.device).eval()
        self.hift = hift.to(self.device).eval()
        self.tokenizer = tokenizer
        self.speaker = speaker
        self.source_cache = MEL_CACHE * config.hift.upsample_factor
        self.fade_window = np.hamming(2 * self.source_cache)
        self.llm = None if llm is None else llm.to(self.device).eval()
        self.text = text
        self.speakers = speakers if speakers is not None else SpeakerStore()
        self.speaker_state = SpeakerState() if speaker_state is True else (speaker_state or None)
        if self.speaker_state is not None:
            self.speaker_state.follow(self.speakers)
        self._tts_dir: Path | None = None  # from_pretrained: where to load the LM from on first use
        self.lm_precision = "fp32"  # of the LM that from_pretrained loads (cosyvoice_triton.models.lm_quant)
        #: the threads and spinning from_pretrained chose (:mod:`~.threads`); None for a model built directly
        self.thread_choice: ThreadChoice | None = None
        #: the streaming hops of token2wav_stream / tokens2wav_stream / tts_stream (default: the official ones)
        self.stream_schedule = StreamSchedule(chunk=config.flow.encoder.static_chunk_size)
        self.prompt_cache = prompt_cache
        #: streaming: non-final chunks compute only their new frames (:mod:`~.models.incremental`, equal to the
        #: recomputing path up to float rounding); a stream whose cached state would pass
        #: ``incremental_cache_bytes`` recomputes every frame from there on
        self.incremental_stream = True
        self.incremental_cache_bytes = DEFAULT_MAX_CACHE_BYTES
        self._prompt_options = prompt_options(tokenizer, speaker, config.mel, config.sample_rate)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str | torch.device = "cpu", onnx_threads: int = 1,
                        tts: bool | None = None, speaker_dir: str | Path | None = None,
                        prompt_cache: PromptCache | bool = True, lm_precision: str = "fp32",
                        stream_schedule: StreamSchedule | None = None, threads: int | None = None,
                        spinning: bool | None = None) -> CosyVoice2:
        """Load an official CosyVoice2 model folder (or a demo folder of the same layout).

        ``tts``: the LM and the text front end (``llm.pt``, ``CosyVoice-BlankEN/``): ``None`` loads them on the first
        text-to-speech call when the folder has them (voice conversion never pays for them), ``True`` requires and
        loads them now, ``False`` never. ``speaker_dir``: where registered speakers persist. ``prompt_cache``: a
        :class:`~.prompt_cache.PromptCache`, ``True`` for a new one with its default bounds, ``False`` for none.
        ``lm_precision``: ``fp32``, ``int8`` or ``fp32-ort`` (:mod:`~.models.lm_quant`, CPU). ``stream_schedule``:
        the streaming hops (:class:`~.streaming.StreamSchedule`; ``None``: the official ones). ``threads`` /
        ``spinning``: torch's intra-op threads and whether idle pool threads spin; ``None``: ``COSYVOICE_THREADS``,
        ``OMP_NUM_THREADS`` or a count set with ``torch.set_num_threads``, else chosen from the free cores
        (:mod:`~.threads`; the choice is :attr:`thread_choice`).
        """
        from .models.lm_quant import LM_PRECISIONS

        if lm_precision not in LM_PRECISIONS:
            raise ConfigError(f"lm_precision must be one of {', '.join(LM_PRECISIONS)}, got {lm_precision!r}")
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model folder not found")
        missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: missing {', '.join(missing)} (a CosyVoice2 folder has "
                                  f"{', '.join(MODEL_FILES)})")
        config = ModelConfig.from_yaml(model_dir / "cosyvoice2.yaml")
        choice = configure(threads, spinning)

        flow = load_flow(model_dir / "flow.pt", config.flow)

        path = model_dir / "hift.pt"
        hift = HiFTGenerator(config.hift)
        load_into(hift, normalize_keys(read_state_dict(path)), path)
        hift.fold_weight_norm()

        tokenizer = SpeechTokenizer(model_dir / "speech_tokenizer_v2.onnx", intra_op_threads=onnx_threads,
                                    spinning=choice.spinning)
        speaker = SpeakerEncoder(model_dir / "campplus.onnx", intra_op_threads=onnx_threads, spinning=choice.spinning)
        features.mel_basis(config.mel)  # build the filter banks (and librosa's lazy imports) now, not per call
        features.whisper_mel_filters(128)
        missing_tts = [name for name in TTS_FILES if not (model_dir / name).is_file()]
        if tts and missing_tts:
            raise CheckpointError(f"{model_dir}: missing {', '.join(missing_tts)} (text-to-speech needs "
                                  f"{', '.join(TTS_FILES)} and the tokenizer files of CosyVoice-BlankEN/)")
        prompt_cache = PromptCache() if prompt_cache is True else (None if prompt_cache is False else prompt_cache)
        model = cls(config, flow, hift, tokenizer, speaker, device=device, speakers=SpeakerStore(speaker_dir),
                    prompt_cache=prompt_cache)
        model.lm_precision = lm_precision
        model.thread_choice = choice
        if stream_schedule is not None:
            model.stream_schedule = model._schedule(stream_schedule)
        if not missing_tts and tts is not False:
            model._tts_dir = model_dir
            if tts:
                model._text()
        return model

    # ------------------------------------------------------------------------------------- front end

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
                  timer: StageTimer = _NO_TIMER, speed: float = 1.0) -> np.ndarray:
        """Non-streaming token-to-waveform (official ``token2wav(finalize=True)``): float32 [N] at 24 kHz.

        HiFT's NSF noise comes from ``hift_noise`` [1, 480 T, 9] when given, else from a generator seeded
        with ``seed`` (which replays what ``torch.manual_seed(seed)`` gives the official code on CPU), else
        from torch's global RNG (``seed=None``). ``speed``: the mel stretched to ``int(T / speed)`` frames
        before HiFT (:func:`~.models.speed.stretch_mel`, the official ``speed``).
        """
        mel = self._flow(inputs, inputs.source_tokens, streaming=False, finalize=True, timer=timer)
        mel = stretch_mel(mel, speed)
        speech, _ = self._hift(mel, None, hift_noise, _generator(seed), timer)
        return speech[0].float().cpu().numpy()

    def token2wav_stream(self, inputs: VCInputs, *, seed: int | None = 0,
                         hift_noise: Sequence[np.ndarray] | None = None, timer: StageTimer = _NO_TIMER,
                         schedule: StreamSchedule | None = None) -> Iterator[np.ndarray]:
        """Official streaming ``tts(stream=True)`` for VC: yields float32 chunks at 24 kHz.

        Chunks of 25, 50, then 100 tokens (the first padded so that prompt + chunk is a multiple of 25),
        each run with chunk-causal attention and 3 look-ahead tokens; HiFT keeps 8 mel frames and 3840
        source samples of context and crossfades 3840 samples with a Hamming window. The hop schedule
        restarts for every call (the official instance keeps doubling across requests; the official
        references use a fresh instance, as here). ``hift_noise``: one array per HiFT call, in order.
        ``schedule``: other hops (:class:`~.streaming.StreamSchedule`; ``None``: :attr:`stream_schedule`).
        """
        ends = self.stream_chunk_ends(len(inputs.source_tokens), len(inputs.prompt_tokens), schedule=schedule)
        if hift_noise is not None and len(hift_noise) <= len(ends):
            raise ValueError(f"hift_noise: {len(hift_noise)} arrays for a stream of {len(ends) + 1} HiFT calls; "
                             "pass one per chunk")
        yield from self.tokens2wav_stream(inputs, inputs.source_tokens.tolist(), seed=seed, hift_noise=hift_noise,
                                          timer=timer, schedule=schedule)

    def tokens2wav_stream(self, inputs: VCInputs, tokens: Iterable[int], *, seed: int | None = 0,
                          hift_noise: Sequence[np.ndarray] | None = None, timer: StageTimer = _NO_TIMER,
                          schedule: StreamSchedule | None = None,
                          speaker: SpeakerPrompt | None = None) -> Iterator[np.ndarray]:
        """:meth:`token2wav_stream` over speech tokens that arrive one by one (the LM's, in streaming TTS).

        A chunk runs as soon as its hop plus the look-ahead tokens have arrived, so the chunks are those of
        :meth:`stream_chunk_ends` for the final token count, whatever the arrival times; the last chunk runs
        when ``tokens`` is exhausted. ``inputs.source_tokens`` is ignored. ``speaker``: the registered
        speaker whose prompt ``inputs`` holds; the stream then starts from its settled prompt frames in
        :attr:`speaker_state`.
        """
        ratio, generator = self.flow.token_mel_ratio, _generator(seed)
        noises = iter(hift_noise) if hift_noise is not None else None
        cache = None
        state = self._flow_state(inputs, speaker, timer) if self.incremental_stream else None
        for chunk in stream_chunks(tokens, len(inputs.prompt_tokens), lookahead=self.flow.pre_lookahead_len,
                                   schedule=self._schedule(schedule)):
            mel = self._stream_flow(inputs, chunk, state, timer)[:, :, chunk.offset * ratio:]
            speech, cache = self._hift_chunk(mel, cache, _next_noise(noises), generator, timer, final=chunk.final)
            yield speech

    def _flow_state(self, inputs: VCInputs, speaker: SpeakerPrompt | None, timer: StageTimer) -> FlowStreamState:
        if speaker is not None and self.speaker_state is not None:
            with timer.stage("speaker_state"), torch.inference_mode():
                _, *prompt = self._tensors(inputs, inputs.prompt_tokens[:0])
                state = self.speaker_state.flow_state(self.flow, speaker, prompt,
                                                      max_cache_bytes=self.incremental_cache_bytes)
            if state is not None:
                return state
        return FlowStreamState(self.incremental_cache_bytes)

    def stream_chunk_ends(self, n_tokens: int, n_prompt_tokens: int, *,
                          schedule: StreamSchedule | None = None) -> list[int]:
        """Where the non-final chunks of :meth:`token2wav_stream` end, in source tokens
        (:func:`~cosyvoice_triton.streaming.stream_chunk_ends` with the flow's look-ahead)."""
        return stream_chunk_ends(n_tokens, n_prompt_tokens, lookahead=self.flow.pre_lookahead_len,
                                 schedule=self._schedule(schedule))

    def _schedule(self, schedule: StreamSchedule | None) -> StreamSchedule:
        if schedule is None:
            return self.stream_schedule
        chunk = self.config.flow.encoder.static_chunk_size
        if schedule.chunk != chunk:
            raise ConfigError(f"stream schedule: aligned to {schedule.chunk}-token chunks, the flow's attention "
                              f"chunk is {chunk} (static_chunk_size)")
        return schedule

    @torch.inference_mode()
    def _stream_flow(self, inputs: VCInputs, chunk, state: FlowStreamState | None, timer: StageTimer) -> torch.Tensor:
        """A stream chunk's mel after the prompt [1, 80, T]: from ``state`` for a non-final chunk (when it has
        one and stays under its cap), else recomputed over every frame (the final chunk has full attention)."""
        if state is not None and not chunk.final:
            mel = incremental_chunk(self.flow, state, *self._tensors(inputs, chunk.tokens), timer=timer)
            if mel is not None:
                return mel
        if state is not None:
            state.reset()
        return self._flow(inputs, chunk.tokens, streaming=not chunk.final, finalize=chunk.final, timer=timer)

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
            new_cache = {"mel": mel[:, :, -MEL_CACHE:], "source": source[:, :, -self.source_cache:],
                         "speech": speech[-self.source_cache:]}
            speech = speech[: -self.source_cache]
        return speech.astype(np.float32), new_cache

    # ------------------------------------------------------------------------------------ end to end

    def convert(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                stream: bool = False, seed: int | None = 0, timer: StageTimer = _NO_TIMER) -> np.ndarray:
        """Voice conversion: speak the content of ``source`` in the voice of ``prompt``.

        Returns float32 [N] at ``config.sample_rate`` (24 kHz). Streaming mode concatenates its chunks.
        A source longer than 30 s (at most :data:`~.longform.MAX_SECONDS`, 10 minutes; not streamed) is
        converted in pieces by :meth:`convert_long`. Bad audio raises :class:`~cosyvoice_triton.errors.AudioError`.
        """
        with timer.stage("frontend"):
            src16 = audio.load_audio(source, target_sr=audio.TOKENIZER_SR, sample_rate=source_sr, name="source",
                                     max_seconds=longform.MAX_SECONDS)
        if longform.needs_split(len(src16)) and not stream:
            return self.convert_long(src16, prompt, prompt_sr=prompt_sr, seed=seed, timer=timer)
        inputs = self.frontend_vc(src16, prompt, source_sr=audio.TOKENIZER_SR, prompt_sr=prompt_sr, timer=timer)
        if stream:
            return np.concatenate(list(self.token2wav_stream(inputs, seed=seed, timer=timer)))
        return self.token2wav(inputs, seed=seed, timer=timer)

    @torch.inference_mode()
    def convert_long(self, source16: np.ndarray, prompt, *, prompt_sr: int | None = None, seed: int | None = 0,
                     batch_size: int = 4, timer: StageTimer = _NO_TIMER) -> np.ndarray:
        """Voice conversion of a 16 kHz source of any length up to :data:`~.longform.MAX_SECONDS`: pieces of at
        most 30 s cut at low-energy points (:func:`~.longform.plan_pieces`), tokenized together, through the flow
        in padded batches of ``batch_size`` pieces, HiFT one piece per call (its NSF noise drawn in order from one
        generator seeded with ``seed``), stitched with crossfades (:func:`~.longform.stitch`)."""
        entry = self.prompt_features(prompt, prompt_sr=prompt_sr, timer=timer)
        generator = _generator(seed)

        def convert(pieces: list[np.ndarray]) -> list[np.ndarray]:
            tokens, outputs = self._tokenize(pieces, timer), []
            for first in range(0, len(pieces), batch_size):
                for mel in self._flow_batch(entry, tokens[first : first + batch_size], timer):
                    speech, _ = self._hift(mel, None, None, generator, timer)
                    outputs.append(speech[0].float().cpu().numpy())
            return outputs

        return longform.convert_in_pieces(source16, convert)

    def _flow_batch(self, entry: CacheEntry, tokens: Sequence[np.ndarray], timer: StageTimer) -> list[torch.Tensor]:
        """Non-streaming flow of several source token sequences with one prompt, as one padded batch: the mel
        [1, 80, T_i] of each."""
        dev, b = self.device, len(tokens)
        lens = torch.tensor([len(t) for t in tokens], dtype=torch.int64, device=dev)
        padded = torch.zeros((b, int(lens.max())), dtype=torch.int32, device=dev)
        for i, t in enumerate(tokens):
            padded[i, : len(t)] = torch.as_tensor(np.asarray(t), dtype=torch.int32)
        repeat = [torch.as_tensor(np.array(entry[k]), device=dev)[None].expand(b, *entry[k].shape)
                  for k in ("prompt_tokens", "prompt_mel", "embedding")]
        with timer.stage("flow.encoder"):
            c = self.flow.condition(padded, repeat[0], repeat[1].float(), repeat[2].float(), token_len=lens,
                                    streaming=False, finalize=True)
        with timer.stage("flow.solver"):
            mel = self.flow.decoder(c.mu, c.mask, c.spks, c.cond, streaming=False)
        mel, out_len = c.crop(mel)
        return [mel[i : i + 1, :, : int(n)] for i, n in enumerate(out_len.tolist())]


    # ------------------------------------------------------------------------------- text to speech

    def _text(self):
        if (self.text is None or self.llm is None) and self._tts_dir is not None:
            from .frontend.text import TextFrontend
            from .models.llm import QWEN_DIR, load_llm  # transformers: only for TTS

            self.llm = load_llm(self._tts_dir, self.config, device=self.device, precision=self.lm_precision)
            self.text = TextFrontend(self._tts_dir / QWEN_DIR)
            self._tts_dir = None
        if self.text is None or self.llm is None:
            raise CheckpointError("text-to-speech needs llm.pt and CosyVoice-BlankEN/ in the model folder "
                                  "(this one was loaded for voice conversion only)")
        return self.text

    def tts_requests(self, text: str | bytes, *, prompt_audio=None, prompt_sr: int | None = None,
                     prompt_text: str | bytes | None = None, instruct: str | bytes | None = None,
                     speaker_id: str | None = None, mode: str | None = None,
                     timer: StageTimer = _NO_TIMER) -> list[TTSRequest]:
        """The LM and flow inputs of each text segment (one :class:`TTSRequest` per segment).

        The mode follows the official API: ``zero_shot`` (prompt text + prompt audio: the LM continues the
        prompt's speech tokens), ``cross_lingual`` (prompt audio without text: the LM gets no prompt),
        ``instruct`` (``inference_instruct2``: the instruction replaces the prompt text, no prompt speech in the
        LM). ``mode=None`` picks instruct when ``instruct`` is given, else zero-shot when a transcript is known.
        The prompt is ``prompt_audio`` or the registered ``speaker_id``; the flow always uses its tokens, mel
        and embedding.
        """
        front = self._text()
        speaker = self._speaker(prompt_audio, prompt_sr, prompt_text, speaker_id, timer)
        with timer.stage("frontend"):
            segments = front.tts_segments(text)
        mode, lm_text, lm_speech = lm_prompt(front, speaker, mode=mode, instruct=instruct)
        return [TTSRequest(text=segment, text_tokens=np.asarray(ids, np.int32), lm_prompt_text_tokens=lm_text,
                           lm_prompt_speech_tokens=lm_speech, prompt=speaker, speaker_id=speaker_id)
                for segment, ids in segments]

    def speech_tokens(self, request: TTSRequest, *, draws=None, timer: StageTimer = _NO_TIMER):
        """The LM's speech tokens of one segment, as an iterator that samples as it is consumed (an
        :class:`~.models.llm.LMStream`). ``draws``: a seeded ``torch.Generator``, an iterable of uniform draws
        (parity), or ``None`` (PyTorch's global generator, as the official code). A registered speaker's
        request (``request.speaker_id``) prefills after the shared prefix of :attr:`speaker_state`."""
        prefix = None
        if request.speaker_id is not None and self.speaker_state is not None:
            with timer.stage("speaker_state"):
                prefix = self.speaker_state.lm_prefix(self.llm, request.lm_prompt_text_tokens)
        return self.llm.generate(request.text_tokens, np.array(request.lm_prompt_text_tokens),
                                 np.array(request.lm_prompt_speech_tokens), draws=draws, prefix=prefix)

    def tts_stream(self, text: str | bytes, *, stream: bool = True, seed: int | None = 0, draws=None,
                   timer: StageTimer = _NO_TIMER, schedule: StreamSchedule | None = None, speed: float = 1.0,
                   **prompt) -> Iterator[np.ndarray]:
        """Text to speech, yielded as float32 chunks at 24 kHz: with ``stream=True`` the official streaming
        schedule (the first audio after 25 + 3 speech tokens), else one array per text segment.

        ``prompt``: the keywords of :meth:`tts_requests`. ``seed`` seeds the LM's sampling and HiFT's noise
        (``None``: PyTorch's global generator); ``draws`` overrides the LM's (parity with injected draws).
        ``schedule``: other streaming hops (:class:`~.streaming.StreamSchedule`; ``None``: :attr:`stream_schedule`).
        ``speed`` (0.25-4, non-streaming only, as the official ``speed``): faster speech above 1, slower below, by
        the final mel's length (:func:`~.models.speed.stretch_mel`).
        """
        if check_speed(speed) != 1.0 and stream:
            raise CosyVoiceError("speed: only non-streaming answers (stream=False) change speed, as the official "
                                 "code's; a stream's chunks are vocoded before the whole mel exists")
        requests = self.tts_requests(text, timer=timer, **prompt)
        if draws is None and seed is not None:
            draws = torch.Generator().manual_seed(int(seed))
        for request in requests:
            inputs = request.flow_inputs()
            tokens = self.speech_tokens(request, draws=draws, timer=timer)
            timed = timer.each(tokens, "llm")
            if stream:
                yield from self.tokens2wav_stream(inputs, timed, seed=seed, timer=timer, schedule=schedule,
                                                  speaker=request.prompt if request.speaker_id else None)
            else:
                inputs.source_tokens = np.asarray(list(timed), dtype=np.int32)
                if not len(inputs.source_tokens):
                    raise LLMError(f"the LM produced no speech token for {request.text!r}")
                yield self.token2wav(inputs, seed=seed, timer=timer, speed=speed)
            if tokens.hit_max_len:
                log.warning("the LM reached its maximum of %d speech tokens without end-of-speech for %r",
                            tokens.max_len, request.text)

    def tts_live(self, text_pieces: Iterable[str | bytes], *, seed: int | None = 0, draws=None,
                 max_token_text_ratio: float = 20, timer: StageTimer = _NO_TIMER, prompt_audio=None,
                 prompt_sr: int | None = None, prompt_text: str | bytes | None = None,
                 instruct: str | bytes | None = None, speaker_id: str | None = None,
                 mode: str | None = None) -> LiveAudio:
        """Text to speech while the text arrives (official ``inference_zero_shot`` / ``inference_cross_lingual`` /
        ``inference_instruct2`` with a text generator): float32 chunks at 24 kHz on the streaming schedule of
        :meth:`tts_stream`, the first as soon as the LM has its speech tokens, before the text ends.

        ``text_pieces``: an iterable of ``str`` / UTF-8 ``bytes`` pieces; it may block (a
        :class:`~.frontend.text.live.LiveText` is fed from another thread and ends with what it has). Each piece
        is tokenized on its own and not normalised (:func:`~.frontend.text.live.piece_tokens`); the prompt
        text is normalised as in :meth:`tts_stream`. The LM decodes with :class:`~.models.bistream.LiveDecode`
        (its stop reason: :attr:`LiveAudio.stop_reason`); it stops, as the served live TTS does, where the flow's
        room ends (:func:`~.shapes.flow_token_room`: the flow graph's tokens axis less the prompt's), or at
        ``max_token_text_ratio`` speech tokens per text token. Prompt keywords, ``seed`` and ``draws``: as
        :meth:`tts_stream`.
        """
        from .frontend.text.live import piece_tokens
        from .models.bistream import live_decode
        from .shapes import flow_token_room

        front = self._text()
        speaker = self._speaker(prompt_audio, prompt_sr, prompt_text, speaker_id, timer)
        _, lm_text, lm_speech = lm_prompt(front, speaker, mode=mode, instruct=instruct)
        if draws is None and seed is not None:
            draws = torch.Generator().manual_seed(int(seed))
        tokens = piece_tokens(front.tokenizer, text_pieces, max_chars=front.max_chars, strict_tags=front.strict_tags)
        decode = live_decode(self.llm, tokens, lm_text, lm_speech, draws=draws,
                             max_token_text_ratio=max_token_text_ratio,
                             max_tokens=flow_token_room(len(speaker.prompt_tokens)))
        inputs = TTSRequest(text="", text_tokens=np.zeros(0, np.int32), lm_prompt_text_tokens=lm_text,
                            lm_prompt_speech_tokens=lm_speech, prompt=speaker).flow_inputs()
        chunks = self.tokens2wav_stream(inputs, timer.each(decode, "llm"), seed=seed, timer=timer,
                                        speaker=speaker if speaker_id is not None else None)
        return LiveAudio(chunks, decode)

    def tts(self, text: str | bytes, *, stream: bool = False, seed: int | None = 0, draws=None,
            timer: StageTimer = _NO_TIMER, schedule: StreamSchedule | None = None, speed: float = 1.0,
            **prompt) -> np.ndarray:
        """Text to speech: float32 [N] at 24 kHz, the segments' audio concatenated (see :meth:`tts_stream`;
        ``speed``: not with ``stream=True``)."""
        return np.concatenate(list(self.tts_stream(text, stream=stream, seed=seed, draws=draws, timer=timer,
                                                   schedule=schedule, speed=speed, **prompt)))


def lm_prompt(front, speaker: SpeakerPrompt, *, mode: str | None, instruct: str | bytes | None
              ) -> tuple[str, np.ndarray, np.ndarray]:
    """(mode, LM prompt text tokens, LM prompt speech tokens) of a request, as the official front end maps its
    modes (:func:`~.models.llm.mode_request`); ``mode=None`` picks instruct when ``instruct`` is given, else
    zero-shot when the prompt's transcript is known, else cross-lingual. Bad combinations raise ``TextError``."""
    from .models.llm import mode_request

    if mode is None:
        mode = "instruct" if instruct is not None else (
            "zero_shot" if len(speaker.prompt_text_tokens) else "cross_lingual")
    if mode not in TTS_MODES:
        raise TextError(f"mode must be one of {', '.join(TTS_MODES)}, got {mode!r}")
    if mode == "instruct" and instruct is None:
        raise TextError("instruct mode needs instruct_text, the instruction text")
    if mode != "instruct" and instruct is not None:
        raise TextError(f"an instruction text (instruct_text) is only used in instruct mode, not {mode}")
    if mode == "zero_shot" and not len(speaker.prompt_text_tokens):
        raise TextError("zero-shot needs the prompt's transcript (prompt_text); without it use cross_lingual")
    lm = mode_request(mode, (0,), instruct_tokens=() if instruct is None else front.instruct_tokens(instruct),
                      prompt_text_tokens=speaker.prompt_text_tokens if mode == "zero_shot" else (),
                      prompt_speech_tokens=speaker.prompt_tokens)
    return (mode, np.asarray(lm.prompt_text_tokens, np.int32).reshape(-1),
            np.asarray(lm.prompt_speech_tokens, np.int32).reshape(-1))


@dataclass
class TTSRequest:
    """One text segment's inputs: the LM's (text tokens and its prompt) and the flow's prompt."""

    text: str
    text_tokens: np.ndarray
    lm_prompt_text_tokens: np.ndarray
    lm_prompt_speech_tokens: np.ndarray
    prompt: SpeakerPrompt
    speaker_id: str | None = None  # the prompt is this registered speaker's

    def flow_inputs(self, tokens: np.ndarray | None = None) -> VCInputs:
        p = self.prompt  # its arrays are read-only (shared by every request of a registered speaker): copies
        return VCInputs(source_tokens=np.zeros(0, np.int32) if tokens is None else tokens,
                        prompt_tokens=np.array(p.prompt_tokens), prompt_mel=np.array(p.prompt_mel),
                        embedding=np.array(p.embedding))


class LiveAudio(Iterator[np.ndarray]):
    """The audio chunks of :meth:`CosyVoice2.tts_live`; :attr:`decode` is the LM's
    :class:`~.models.bistream.LiveDecode` (speech tokens, stop reason)."""

    def __init__(self, chunks: Iterator[np.ndarray], decode):
        self._chunks, self.decode = chunks, decode

    def __next__(self) -> np.ndarray:
        return next(self._chunks)

    @property
    def stop_reason(self) -> str | None:
        """Why the LM stopped (:data:`~.models.bistream.STOP_REASONS`); None while it runs."""
        return self.decode.stop_reason

    def close(self) -> None:
        self._chunks.close()
        self.decode.close()


def _next_noise(noises: Iterator[np.ndarray] | None) -> np.ndarray | None:
    if noises is None:
        return None
    try:
        return next(noises)
    except StopIteration:
        raise ValueError("hift_noise: fewer arrays than HiFT calls in the stream; pass one per chunk") from None


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(int(seed))
