"""In-process CosyVoice3: every mode of the official ``CosyVoice3`` class, as one object.

``CosyVoice3.from_pretrained(model_dir)`` loads a Fun-CosyVoice3 folder (``cosyvoice3.yaml``, ``llm.pt``,
``flow.pt``, ``hift.pt``, ``speech_tokenizer_v3.onnx``, ``campplus.onnx``, ``CosyVoice-BlankEN/``; a folder of
another family is refused). The modes, each a generator of float32 chunks at 24 kHz (``*_stream``) and a function
returning the whole answer:

- :meth:`CosyVoice3.vc`: ``inference_vc``: the source's speech tokens straight to the flow, in the prompt's voice;
- :meth:`CosyVoice3.tts_zero_shot`: ``inference_zero_shot``: the LM continues the prompt's speech tokens after the
  prompt text, which holds the system prompt and ``<|endofprompt|>`` before the transcript;
- :meth:`CosyVoice3.cross_lingual`: ``inference_cross_lingual``: no LM prompt; the text starts with the system
  prompt and ``<|endofprompt|>``;
- :meth:`CosyVoice3.instruct2`: ``inference_instruct2``: the instruct text (``"You are a helpful assistant.
  <instruction><|endofprompt|>"``) in place of the prompt text, no prompt speech tokens in the LM.

The front end is CosyVoice2's (:class:`~cosyvoice_triton.prompt_frontend.PromptFrontend`: speech tokens, mel and
CAM++ of the prompt, the prompt cache) with CosyVoice3's speech tokenizer, mel settings and text tokenizer; the
text is normalised and split as officially (a text holding ``<|`` and ``|>`` is one segment, as it stands). The
LM (:class:`~.llm.CosyVoice3LM`) samples each segment's speech tokens, reproducibly from ``seed``; the silent-token
filter of ``llm_job`` (:func:`~.llm.drop_long_silences`) runs before the flow; :class:`~.token2wav.Token2Wav3`
turns them into audio, non-streaming (with ``speed``) or on the official streaming schedule (the first chunk after
25 + 3 tokens). The vocoder's NSF noise is its seeded buffer (``hift_noise_seed``), the same on every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...errors import CheckpointError, ConfigError, LLMError, TextError
from ...family import COSYVOICE2, COSYVOICE3, FAMILY_YAML, check_model_folder, model_family
from ...frontend import features
from ...frontend.speech_models import SpeakerEncoder, SpeechTokenizer
from ...frontend.text.cosyvoice3 import cross_lingual_text, require_endofprompt
from ...pipeline import LiveAudio
from ...prompt_cache import PromptCache
from ...prompt_frontend import _NO_TIMER, PromptFrontend, StageTimer, VCInputs, prompt_options
from ...speakers import SpeakerPrompt, SpeakerStore
from ...streaming import RuntimeSchedule, StreamSchedule
from ...threads import ThreadChoice, configure
from ..llm import LMRequest
from ..speed import check_speed
from .config import CosyVoice3Config, read_cosyvoice3_yaml
from .dit_quant import FLOW_PRECISIONS, quantize_flow3
from .flow import load_flow3
from .hift import load_hift3
from .incremental import DEFAULT_MAX_BYTES, Flow3StreamState
from .llm import CosyVoice3LM, drop_long_silences, load_llm3
from .token2wav import Token2Wav3

log = logging.getLogger(__name__)

SPEECH_TOKENIZER = "speech_tokenizer_v3.onnx"
#: The modes of :meth:`CosyVoice3.tts_stream` (the official method names without ``inference_``).
MODES = ("zero_shot", "cross_lingual", "instruct2")


@dataclass
class Segment:
    """One text segment's LM input and the flow's prompt (what the official ``frontend_*`` hands to ``tts``)."""

    text: str
    text_tokens: np.ndarray
    lm_prompt_text_tokens: np.ndarray
    lm_prompt_speech_tokens: np.ndarray
    prompt: SpeakerPrompt


class CosyVoice3(PromptFrontend):
    """The models of one CosyVoice3 folder on one torch device (CPU by default). ``prompt_cache``: as
    :class:`~cosyvoice_triton.pipeline.CosyVoice2`'s (a repeated prompt recording reuses its tokens, mel and
    embedding); ``speakers``: prompts registered with :meth:`register_speaker`, used through ``speaker_id``."""

    family = COSYVOICE3

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM | None, token2wav: Token2Wav3,
                 tokenizer: SpeechTokenizer, speaker: SpeakerEncoder, text=None, *,
                 prompt_cache: PromptCache | None = None, speakers: SpeakerStore | None = None):
        self.config = config
        self.token2wav_model = token2wav
        self.device = token2wav.device
        self.flow, self.hift = token2wav.flow, token2wav.hift
        self.llm = None if llm is None else llm.to(self.device).eval()
        self.text = text
        self.tokenizer = tokenizer
        self.speaker = speaker
        self.prompt_cache = prompt_cache
        self.speakers = speakers if speakers is not None else SpeakerStore()
        self._prompt_options = prompt_options(tokenizer, speaker, config.mel, config.sample_rate)
        self.sample_rate = config.sample_rate
        #: the threads and spinning from_pretrained chose; None for a model built directly
        self.thread_choice: ThreadChoice | None = None
        #: decodes each text segment's LM request in a shared in-flight batch (``lm_submit(request)`` -> an iterator
        #: of its tokens with ``hit_max_len``, e.g. :meth:`cosyvoice_triton.serving.stages.lm_engine.LMEngine.stream`
        #: when several requests compute at once); None: each segment on a decoder of its own
        self.lm_submit: Callable[[LMRequest], Iterator[int]] | None = None
        #: streaming: non-final chunks compute only the frames they do not already hold (:mod:`.incremental`, equal
        #: to the official recompute up to float rounding); False: every chunk recomputes the prompt and every frame
        #: so far, as the official code. A stream whose state would pass ``incremental_cache_bytes`` recomputes from
        #: there on
        self.incremental_stream = True
        self.incremental_cache_bytes = DEFAULT_MAX_BYTES
        #: makes each stream's state in place of ``Flow3StreamState(incremental_cache_bytes)`` (a server's, counted
        #: against an instance's budget); None: that default
        self.stream_state: Callable[[], Flow3StreamState] | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, device: str | torch.device = "cpu", onnx_threads: int = 1,
                        tts: bool = True, prompt_cache: PromptCache | bool = True, lm_precision: str = "fp32",
                        hift_noise_seed: int = 0, speaker_dir: str | Path | None = None,
                        stream_schedule: StreamSchedule | None = None, threads: int | None = None,
                        spinning: bool | None = None, text_limits: Mapping[str, int] | None = None,
                        flow_precision: str = "fp32") -> CosyVoice3:
        """Load a CosyVoice3 model folder (the official one, or a demo folder of the same layout).

        Every loader is strict (keys and shapes, ``weights_only``). A folder of another family (by the official
        ``AutoModel`` rule: its yaml) or without one of the files is refused with a :class:`ConfigError` naming
        what is wrong. ``tts=False`` skips the LM and the text front end (voice conversion only).
        ``hift_noise_seed``: the seed of the vocoder's NSF noise buffer (the official code draws it from torch's
        global generator when it builds the vocoder). ``lm_precision``, ``threads``, ``spinning``,
        ``prompt_cache``, ``speaker_dir``: as for :meth:`CosyVoice2.from_pretrained
        <cosyvoice_triton.pipeline.CosyVoice2.from_pretrained>`. ``stream_schedule``: other streaming hops.
        ``text_limits``: keywords of the text front end's limits (``max_chars``, ``max_digit_run``, ``max_digits``).
        ``flow_precision``: ``fp32``, or ``int8`` (the DiT blocks' Linear layers on PyTorch's CPU INT8:
        :mod:`.dit_quant`).
        """
        from ...models.lm_quant import LM_PRECISIONS

        if lm_precision not in LM_PRECISIONS:
            raise ConfigError(f"lm_precision must be one of {', '.join(LM_PRECISIONS)}, got {lm_precision!r}")
        if flow_precision not in FLOW_PRECISIONS:
            raise ConfigError(f"flow_precision must be one of {', '.join(FLOW_PRECISIONS)}, got {flow_precision!r}")
        if flow_precision != "fp32" and torch.device(device).type != "cpu":
            raise ConfigError(f"flow_precision {flow_precision} is PyTorch's CPU INT8: load on the CPU (device cpu)")
        model_dir = Path(model_dir)
        family = model_family(model_dir)
        if family != COSYVOICE3:
            hint = " (load it with cosyvoice_triton.pipeline.CosyVoice2)" if family == COSYVOICE2 else ""
            raise ConfigError(f"{model_dir}: a {family} folder ({FAMILY_YAML[family]}), not CosyVoice3{hint}")
        check_model_folder(model_dir, COSYVOICE3)
        config = read_cosyvoice3_yaml(model_dir)
        choice = configure(threads, spinning)
        flow = quantize_flow3(load_flow3(model_dir / "flow.pt", config.flow), flow_precision)
        hift = load_hift3(model_dir / "hift.pt", config.hift, noise_seed=hift_noise_seed)
        token2wav = Token2Wav3(flow, hift, device=device, schedule=stream_schedule)
        tokenizer = SpeechTokenizer(model_dir / SPEECH_TOKENIZER, version="v3", intra_op_threads=onnx_threads,
                                    spinning=choice.spinning)
        speaker = SpeakerEncoder(model_dir / "campplus.onnx", intra_op_threads=onnx_threads, spinning=choice.spinning)
        features.mel_basis(config.mel)
        features.whisper_mel_filters(128)
        llm = text = None
        if tts:
            from ...frontend.text import TextFrontend
            from ..llm import QWEN_DIR

            llm = load_llm3(model_dir, config.llm, device=device, precision=lm_precision)
            text = TextFrontend(model_dir / QWEN_DIR, family=COSYVOICE3, **(text_limits or {}))
        cache = PromptCache() if prompt_cache is True else (None if prompt_cache is False else prompt_cache)
        model = cls(config, llm, token2wav, tokenizer, speaker, text, prompt_cache=cache,
                    speakers=SpeakerStore(speaker_dir))
        model.thread_choice = choice
        return model

    def _text(self):
        if self.text is None or self.llm is None:
            raise CheckpointError("text-to-speech needs the LM and the text front end (this model was loaded with "
                                  "tts=False, or built without them)")
        return self.text

    # ------------------------------------------------------------------------------------------ voice conversion
    def vc_stream(self, source, prompt, *, source_sr: int | None = None, prompt_sr: int | None = None,
                  stream: bool = True, speed: float = 1.0, timer: StageTimer = _NO_TIMER) -> Iterator[np.ndarray]:
        """Official ``inference_vc``: the content of ``source`` in the voice of ``prompt`` (paths, encoded bytes,
        or samples with ``*_sr``), float32 chunks at 24 kHz: the official streaming chunks with ``stream=True``,
        else one array (``speed`` 0.25-4: non-streaming only, as officially)."""
        inputs = self.frontend_vc(source, prompt, source_sr=source_sr, prompt_sr=prompt_sr, timer=timer)
        yield from self._token2wav(inputs, inputs.source_tokens.tolist(), stream=stream, speed=speed, timer=timer)

    def vc(self, source, prompt, **kw) -> np.ndarray:
        """:meth:`vc_stream` concatenated (``stream=False`` unless given)."""
        kw.setdefault("stream", False)
        return np.concatenate(list(self.vc_stream(source, prompt, **kw)))

    # ------------------------------------------------------------------------------------------- text to speech
    def segments(self, mode: str, text: str | bytes, *, prompt_wav=None, prompt_sr: int | None = None,
                 prompt_text: str | bytes | None = None, instruct_text: str | bytes | None = None,
                 speaker_id: str | None = None, speaker: SpeakerPrompt | None = None, text_frontend: bool = True,
                 timer: StageTimer = _NO_TIMER) -> list[Segment]:
        """The LM and flow inputs of each text segment of ``mode`` (:data:`MODES`), as the official
        ``inference_<mode>`` arranges them: the text normalised and split (``text_frontend``), the prompt text
        normalised unsplit, the instruct text as given. ``<|endofprompt|>`` must be in the prompt / instruct text or
        the text (:func:`~cosyvoice_triton.frontend.text.cosyvoice3.require_endofprompt`: a :class:`TextError`
        that says where it belongs). The prompt is ``prompt_wav``, a registered ``speaker_id``, or ``speaker``: a
        CosyVoice3 prompt already looked up elsewhere (a server's speakers model), used as a registered one."""
        front = self._text()
        raw_text = front.check(text)
        lm_text, lm_speech, speaker = self._lm_prompt(
            mode, raw_text, prompt_wav=prompt_wav, prompt_sr=prompt_sr, prompt_text=prompt_text,
            instruct_text=instruct_text, speaker_id=speaker_id, speaker=speaker, timer=timer)
        with timer.stage("frontend"):
            pieces = front.tts_segments(raw_text, text_frontend=text_frontend)
        return [Segment(text=s, text_tokens=np.asarray(ids, np.int32), lm_prompt_text_tokens=lm_text,
                        lm_prompt_speech_tokens=lm_speech, prompt=speaker) for s, ids in pieces]

    def _lm_prompt(self, mode: str, raw_text: str | None, *, prompt_wav=None, prompt_sr: int | None = None,
                   prompt_text: str | bytes | None = None, instruct_text: str | bytes | None = None,
                   speaker_id: str | None = None, speaker: SpeakerPrompt | None = None,
                   timer: StageTimer = _NO_TIMER) -> tuple[np.ndarray, np.ndarray, SpeakerPrompt]:
        """(LM prompt text tokens, LM prompt speech tokens, the flow's prompt) of ``mode``; ``raw_text``: the
        checked text, or None for text arriving in pieces (cross-lingual: the system prompt is the prompt text)."""
        front = self._text()
        if mode not in MODES:
            raise TextError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "instruct2" and instruct_text is None:
            raise TextError("instruct2 needs instruct_text, e.g. 'You are a helpful assistant. <instruction>"
                            "<|endofprompt|>'")
        if mode != "instruct2" and instruct_text is not None:
            raise TextError(f"instruct_text is only used by instruct2, not {mode}")
        registered = speaker_id is not None or speaker is not None
        if mode == "zero_shot" and prompt_text is None and not registered:
            raise TextError("zero_shot needs prompt_text: 'You are a helpful assistant.<|endofprompt|>' and the "
                            "transcript of the prompt audio")
        if mode != "zero_shot" and prompt_text is not None:
            raise TextError(f"prompt_text is only used by zero_shot, not {mode}")
        streamed = raw_text is None
        lm_prompt_raw = {"zero_shot": prompt_text, "instruct2": instruct_text}.get(mode)
        if lm_prompt_raw is not None:
            lm_prompt_raw = front.check(lm_prompt_raw, what="instruct text" if mode == "instruct2" else "prompt text")
        elif streamed:
            lm_prompt_raw = cross_lingual_text("")
        if speaker is None:
            speaker = self._speaker(prompt_wav, prompt_sr, prompt_text, speaker_id, timer)
        elif prompt_wav is not None or speaker_id is not None or prompt_text is not None:
            raise TextError("a given speaker prompt stands alone: no prompt audio, speaker_id or prompt text with it")
        else:
            speaker = speaker.require_family(self.family, "given")
        if mode == "zero_shot" and registered:
            lm_prompt_raw = speaker.prompt_text
        require_endofprompt(lm_prompt_raw or "", raw_text or "", mode=mode, streamed=streamed)
        with timer.stage("frontend"):
            if mode == "zero_shot":
                lm_text = speaker.prompt_text_tokens
            elif mode == "instruct2" or streamed:
                lm_text = front.tokenizer.encode(lm_prompt_raw)
            else:
                lm_text = np.zeros(0, np.int32)
        lm_speech = speaker.prompt_tokens if mode == "zero_shot" else np.zeros(0, np.int32)
        return (np.asarray(lm_text, np.int32).reshape(-1), np.asarray(lm_speech, np.int32).reshape(-1), speaker)

    def tts_live(self, mode: str, text_pieces: Iterable[str | bytes], *, seed: int | None = 0, draws=None,
                 max_token_text_ratio: float = 20, cancelled=None, timer: StageTimer = _NO_TIMER,
                 **prompt) -> LiveAudio:
        """Text to speech while the text arrives (official ``inference_<mode>`` with a text generator): float32
        chunks at 24 kHz on the streaming schedule, the first as soon as the LM has its speech tokens, before the
        text ends.

        ``text_pieces``: ``str`` / UTF-8 ``bytes`` pieces; it may block (a
        :class:`~cosyvoice_triton.frontend.text.live.LiveText`). Each piece is tokenized on its own, not
        normalised, token by token to the LM (the official ``_extract_text_token_generator``), which decodes with
        :class:`~cosyvoice_triton.models.bistream.LiveDecode` on CosyVoice3's layout: the prompt text up to
        ``<|endofprompt|>`` first. Its silent-token filter (``llm_job``) runs before the flow. ``mode`` and
        ``prompt``: as :meth:`segments`. The official code asserts a prompt text with ``<|endofprompt|>``, which
        cross-lingual mode has not; here cross-lingual takes the official examples' system prompt
        (``"You are a helpful assistant.<|endofprompt|>"``, which they put in front of a cross-lingual text) as its
        prompt text. Where the official decoding raises (a stop id sampled while the text is read), this ends
        (:attr:`~cosyvoice_triton.pipeline.LiveAudio.stop_reason` ``unexpected_token``) with the audio so far.
        ``cancelled``: a callable checked before every LM step (stop reason ``cancelled``)."""
        from ...frontend.text.live import piece_tokens
        from ..bistream import live_decode

        front = self._text()
        lm_text, lm_speech, speaker = self._lm_prompt(mode, None, timer=timer, **prompt)
        if draws is None and seed is not None:
            draws = torch.Generator().manual_seed(int(seed))
        tokens = piece_tokens(front.tokenizer, text_pieces, max_chars=front.max_chars, strict_tags=front.strict_tags)
        decode = live_decode(self.llm, tokens, lm_text, lm_speech, draws=draws, cancelled=cancelled,
                             max_token_text_ratio=max_token_text_ratio)
        inputs = VCInputs(source_tokens=np.zeros(0, np.int32), prompt_tokens=np.array(speaker.prompt_tokens),
                          prompt_mel=np.array(speaker.prompt_mel), embedding=np.array(speaker.embedding))
        chunks = self._token2wav(inputs, timer.each(drop_long_silences(decode), "llm"), stream=True, speed=1.0,
                                 timer=timer)
        return LiveAudio(chunks, decode)

    def speech_tokens(self, segment: Segment, *, draws=None) -> Iterator[int]:
        """The speech tokens the flow gets for one segment, as they are sampled: the LM's, less the silent tokens
        past a run of five (``llm_job``). ``draws``: a seeded ``torch.Generator``, an iterable of uniform draws
        (parity), or ``None`` (torch's global generator, as the official code)."""
        if self.lm_submit is not None:
            stream = self.lm_submit(LMRequest(segment.text_tokens, segment.lm_prompt_text_tokens,
                                              segment.lm_prompt_speech_tokens, draws=draws))
        else:
            stream = self.llm.generate(segment.text_tokens, segment.lm_prompt_text_tokens,
                                       segment.lm_prompt_speech_tokens, draws=draws)
        return _Tokens(stream, segment.text)

    def tts_stream(self, mode: str, text: str | bytes, *, stream: bool = True, speed: float = 1.0,
                   seed: int | None = 0, draws=None, text_frontend: bool = True, timer: StageTimer = _NO_TIMER,
                   schedule: StreamSchedule | RuntimeSchedule | None = None, **prompt) -> Iterator[np.ndarray]:
        """Text to speech in ``mode`` (:data:`MODES`), float32 chunks at 24 kHz: with ``stream=True`` the
        official streaming chunks of each segment, else one array per segment (``speed``: non-streaming only).
        ``prompt``: the keywords of :meth:`segments`. ``seed`` seeds the LM's sampling (one generator for the
        whole text; ``None``: torch's global generator); ``draws`` overrides it (parity with injected draws).
        ``schedule``: the streaming hops of this request (default: the model's)."""
        check_speed(speed)
        segments = self.segments(mode, text, text_frontend=text_frontend, timer=timer, **prompt)
        if draws is None and seed is not None:
            draws = torch.Generator().manual_seed(int(seed))
        for segment in segments:
            p = segment.prompt
            inputs = VCInputs(source_tokens=np.zeros(0, np.int32), prompt_tokens=np.array(p.prompt_tokens),
                              prompt_mel=np.array(p.prompt_mel), embedding=np.array(p.embedding))
            tokens = timer.each(self.speech_tokens(segment, draws=draws), "llm")
            yield from self._token2wav(inputs, tokens, stream=stream, speed=speed, timer=timer, text=segment.text,
                                       schedule=schedule)

    def tts_zero_shot_stream(self, text, prompt_text, prompt_wav=None, **kw) -> Iterator[np.ndarray]:
        """Official ``inference_zero_shot(tts_text, prompt_text, prompt_wav)`` (keywords: :meth:`tts_stream`'s,
        ``prompt_sr``, ``speaker_id`` in place of ``prompt_wav`` and ``prompt_text``)."""
        return self.tts_stream("zero_shot", text, prompt_text=prompt_text, prompt_wav=prompt_wav, **kw)

    def cross_lingual_stream(self, text, prompt_wav=None, **kw) -> Iterator[np.ndarray]:
        """Official ``inference_cross_lingual(tts_text, prompt_wav)``."""
        return self.tts_stream("cross_lingual", text, prompt_wav=prompt_wav, **kw)

    def instruct2_stream(self, text, instruct_text, prompt_wav=None, **kw) -> Iterator[np.ndarray]:
        """Official ``inference_instruct2(tts_text, instruct_text, prompt_wav)``."""
        return self.tts_stream("instruct2", text, instruct_text=instruct_text, prompt_wav=prompt_wav, **kw)

    def tts(self, mode: str, text, **kw) -> np.ndarray:
        """:meth:`tts_stream` concatenated (``stream=False`` unless given)."""
        kw.setdefault("stream", False)
        return np.concatenate(list(self.tts_stream(mode, text, **kw)))

    def tts_zero_shot(self, text, prompt_text, prompt_wav=None, **kw) -> np.ndarray:
        """:meth:`tts_zero_shot_stream` as one array (``stream=False`` unless given)."""
        return self.tts("zero_shot", text, prompt_text=prompt_text, prompt_wav=prompt_wav, **kw)

    def cross_lingual(self, text, prompt_wav=None, **kw) -> np.ndarray:
        """:meth:`cross_lingual_stream` as one array."""
        return self.tts("cross_lingual", text, prompt_wav=prompt_wav, **kw)

    def instruct2(self, text, instruct_text, prompt_wav=None, **kw) -> np.ndarray:
        """:meth:`instruct2_stream` as one array."""
        return self.tts("instruct2", text, instruct_text=instruct_text, prompt_wav=prompt_wav, **kw)

    # ------------------------------------------------------------------------------------------- token to wav
    def _token2wav(self, inputs: VCInputs, tokens, *, stream: bool, speed: float, timer: StageTimer,
                   text: str | None = None, schedule: StreamSchedule | RuntimeSchedule | None = None
                   ) -> Iterator[np.ndarray]:
        t2w = self.token2wav_model
        prompt = (inputs.prompt_tokens, inputs.prompt_mel, inputs.embedding)
        if stream:
            if check_speed(speed) != 1.0:
                raise ConfigError("speed: only non-streaming answers (stream=False) change speed, as officially")
            state = None
            if self.incremental_stream:
                state = self.stream_state() if self.stream_state is not None else \
                    Flow3StreamState(self.incremental_cache_bytes)
            yield from timer.each(t2w.token2wav_stream(tokens, *prompt, schedule=schedule, state=state),
                                  "token2wav")
            return
        tokens = np.asarray(list(tokens), np.int32)
        if not len(tokens):
            raise LLMError(f"the LM produced no speech token for {text!r}")
        with timer.stage("token2wav"):
            yield t2w.token2wav(tokens, *prompt, speed=speed)


class _Tokens(Iterator[int]):
    """The LM's tokens of one segment through the silent-token filter; logs a stop at ``max_len``."""

    def __init__(self, stream, text: str):
        self.lm, self._filtered, self._text = stream, drop_long_silences(stream), text

    def __next__(self) -> int:
        try:
            return next(self._filtered)
        except StopIteration:
            if self.lm.hit_max_len:
                log.warning("the LM reached its maximum of %d speech tokens without end-of-speech for %r",
                            self.lm.max_len, self._text)
            raise

