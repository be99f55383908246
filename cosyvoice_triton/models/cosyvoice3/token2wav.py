"""CosyVoice3's speech tokens to waveform: the official ``CosyVoice3Model.token2wav`` and the token part of ``tts``.

The flow (:class:`~.flow.CausalMaskedDiffWithDiT`) turns prompt + source tokens into mel; the causal vocoder
(:class:`~.hift.CausalHiFTGenerator`) turns mel into 24 kHz audio. Voice conversion hands the source's tokens to
this path directly (the official ``vc_job``); text-to-speech hands it the LM's tokens as they are decoded.

- Non-streaming: one flow call on every token (``streaming=False, finalize=True``), the mel optionally stretched by
  ``speed`` (:func:`~cosyvoice_triton.models.speed.stretch_mel`, the official ``F.interpolate``), one vocoder call
  with ``finalize=True``.
- Streaming: CosyVoice2's hops (:mod:`cosyvoice_triton.streaming`: 25, 50, then 100 tokens, the first padded so
  that prompt + hop is a multiple of the DiT's 25-token attention chunk; each chunk waits for the flow's 3
  look-ahead tokens). A chunk runs the flow on *every* token so far (``streaming=True, finalize=False``) and keeps
  the mel from the chunk's first token on. The vocoder has no crossfade and no source cache, unlike CosyVoice2's:
  it runs on the whole mel so far (every chunk's mel, concatenated) with ``finalize=False`` and the samples past
  those already returned are the chunk's audio. The last chunk, with every token, runs the flow with
  ``streaming=False, finalize=True`` (the official ``tts`` does not pass ``stream`` to its last ``token2wav``
  call) and the vocoder with ``finalize=True``. Given a stream state, the non-final chunks compute only their new
  frames and the vocoder runs on a bounded window (:meth:`Token2Wav3.token2wav_stream`; :mod:`.incremental`).

The hops restart at 25 for every stream. The official ``tts`` stores the grown hop on the model
(``self.token_hop_len``) and never resets it, so an official instance's second stream starts at 100 tokens; the
project's references use a fresh official instance per stream.

The vocoder's NSF noise is its own seeded buffer (:class:`~.hift.CausalNsfNoise`): sample ``i`` gets the same
noise in every call, so the stream's chunks are the samples a single call would give, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from ...errors import ConfigError, CosyVoiceError
from ...streaming import RuntimeSchedule, StreamSchedule, stream_chunks
from ...streaming import stream_chunk_ends as _chunk_ends
from ..speed import check_speed, stretch_mel
from .flow import CausalMaskedDiffWithDiT, Flow3Dims
from .hift import CausalHiFTGenerator
from .incremental import Flow3StreamState, incremental_chunk3
from .vocoder_window import VocoderWindow


def stream_schedule(dims: Flow3Dims | None = None, *, first_hop: int | None = None, growth: int | None = None,
                    max_hop: int | None = None) -> StreamSchedule:
    """The streaming hops for a flow of ``dims`` (default: the release's): aligned to the DiT's attention chunk in
    tokens (``static_chunk_size / token_mel_ratio``, 25); the official hops unless given."""
    d = dims or Flow3Dims.full()
    frames, ratio = d.dit.static_chunk_size, d.token_mel_ratio
    if frames % ratio:
        raise ConfigError(f"the DiT's static_chunk_size ({frames} frames) is not a whole number of tokens "
                          f"(token_mel_ratio {ratio})")
    base = StreamSchedule()
    return StreamSchedule(first_hop=base.first_hop if first_hop is None else first_hop,
                          growth=base.growth if growth is None else growth,
                          max_hop=base.max_hop if max_hop is None else max_hop, chunk=frames // ratio)


def stream_chunk_ends(n_tokens: int, n_prompt_tokens: int, dims: Flow3Dims | None = None, *,
                      schedule: StreamSchedule | None = None) -> list[int]:
    """Where the non-final chunks of a CosyVoice3 stream of ``n_tokens`` source tokens after ``n_prompt_tokens``
    prompt tokens end, in source tokens (the final chunk, ending at ``n_tokens``, is not listed). A pure function
    of the counts, the flow's look-ahead and attention chunk (``dims``) and the hops (``schedule``: the official
    ones by default)."""
    d = dims or Flow3Dims.full()
    return _chunk_ends(n_tokens, n_prompt_tokens, lookahead=d.pre_lookahead_len,
                       schedule=schedule or stream_schedule(d))


class _Vocoded:
    """A stream's vocoder, as the official ``hift_cache_dict`` entry: every mel frame so far, vocoded whole at each
    chunk, and how many samples were returned. Call it with each chunk's new mel [1, 80, n]."""

    def __init__(self, hift: CausalHiFTGenerator):
        self.hift = hift
        self.mel: torch.Tensor | None = None
        self.samples = 0

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, *, final: bool) -> np.ndarray:
        self.mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=2)
        speech, _ = self.hift.inference(self.mel, finalize=final)
        new = speech[0, self.samples:]
        self.samples += new.shape[0]
        return new.float().cpu().numpy()


class Token2Wav3:
    """CosyVoice3's flow and causal vocoder, token to waveform, on one torch device (module docstring).

    Inputs are one utterance without a batch axis: ``tokens`` [Ts] and ``prompt_tokens`` [Tp] int speech tokens
    (25 Hz), ``prompt_feat`` [Tf, 80] the prompt's mel (50 Hz), ``embedding`` [192] the prompt's speaker embedding.
    Outputs are float32 numpy audio at the vocoder's rate (24 kHz).
    """

    def __init__(self, flow: CausalMaskedDiffWithDiT, hift: CausalHiFTGenerator, *,
                 device: str | torch.device = "cpu", schedule: StreamSchedule | RuntimeSchedule | None = None):
        self.device = torch.device(device)
        self.flow = flow.to(self.device).eval()
        self.hift = hift.to(self.device).eval()
        own = stream_schedule(flow.dims)
        if schedule is not None and schedule.chunk != own.chunk:
            raise ConfigError(f"stream schedule: aligned to {schedule.chunk}-token chunks, the DiT's attention chunk "
                              f"is {own.chunk} tokens")
        #: the streaming hops (default: the official ones)
        self.schedule = schedule or own
        self.sample_rate = hift.dims.sampling_rate

    def stream_chunk_ends(self, n_tokens: int, n_prompt_tokens: int) -> list[int]:
        """:func:`stream_chunk_ends` for this flow and :attr:`schedule`."""
        return stream_chunk_ends(n_tokens, n_prompt_tokens, self.flow.dims, schedule=self.schedule)

    # ------------------------------------------------------------------------------------------ inputs
    def _prompt(self, prompt_tokens, prompt_feat, embedding) -> tuple[torch.Tensor, ...]:
        dev = self.device
        # copies (torch.tensor): the inputs may be read-only views of request tensors
        prompt_tokens = torch.tensor(np.asarray(prompt_tokens), dtype=torch.int32, device=dev).reshape(1, -1)
        prompt_feat = torch.tensor(np.asarray(prompt_feat), dtype=torch.float32, device=dev)
        embedding = torch.tensor(np.asarray(embedding), dtype=torch.float32, device=dev).reshape(1, -1)
        d = self.flow.dims
        if prompt_feat.ndim != 2 or prompt_feat.shape[1] != d.output_size:
            raise CosyVoiceError(f"prompt_feat: expected [frames, {d.output_size}], got {list(prompt_feat.shape)}")
        if embedding.shape[1] != d.spk_embed_dim:
            raise CosyVoiceError(f"embedding: expected {d.spk_embed_dim} values, got {embedding.shape[1]}")
        return prompt_tokens, prompt_feat[None], embedding

    def _tokens(self, tokens) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.int32, device=self.device).reshape(1, -1)
        if t.shape[1] == 0:
            raise CosyVoiceError("no speech tokens to synthesise")
        vocab = self.flow.dims.vocab_size
        if int(t.max()) >= vocab:
            raise CosyVoiceError(f"speech token {int(t.max())} is out of range: the flow has {vocab}")
        return t

    @torch.inference_mode()
    def _mel(self, tokens: torch.Tensor, prompt: tuple[torch.Tensor, ...], *, streaming: bool,
             finalize: bool) -> torch.Tensor:
        mel, _ = self.flow.inference(tokens, *prompt, streaming=streaming, finalize=finalize)
        return mel  # [1, 80, frames after the prompt's]

    # ---------------------------------------------------------------------------------------- one shot
    @torch.inference_mode()
    def token2wav(self, tokens, prompt_tokens, prompt_feat, embedding, *, speed: float = 1.0) -> np.ndarray:
        """Every token at once (official ``tts(stream=False)``): float32 [N]. ``speed``: the mel is stretched to
        ``int(T / speed)`` frames before the vocoder."""
        speed = check_speed(speed)
        mel = self._mel(self._tokens(tokens), self._prompt(prompt_tokens, prompt_feat, embedding), streaming=False,
                        finalize=True)
        speech, _ = self.hift.inference(stretch_mel(mel, speed), finalize=True)
        return speech[0].float().cpu().numpy()

    # --------------------------------------------------------------------------------------- streaming
    def token2wav_stream(self, tokens: Iterable[int], prompt_tokens, prompt_feat, embedding, *,
                         schedule: StreamSchedule | RuntimeSchedule | None = None,
                         state: Flow3StreamState | None = None) -> Iterator[np.ndarray]:
        """Official ``tts(stream=True)`` over ``tokens`` as they arrive (a list, or an iterator that may block):
        float32 chunks, one per chunk of :meth:`stream_chunk_ends` and the last when ``tokens`` ends. Their
        concatenation is the stream's audio. ``schedule``: this stream's hops (default :attr:`schedule`; the
        official Triton runtime's: :class:`~cosyvoice_triton.streaming.RuntimeSchedule`).

        ``state``: a fresh :class:`~.incremental.Flow3StreamState`, this stream's own: the non-final chunks then
        compute only the frames they do not already hold (:mod:`.incremental`) and the vocoder runs on a bounded
        window (:class:`~.vocoder_window.VocoderWindow`), each equal to the official recompute up to float rounding.
        It is closed before the final chunk (which recomputes, full attention) and whenever the stream stops."""
        ratio = self.flow.token_mel_ratio
        vocode = _Vocoded(self.hift) if state is None else VocoderWindow(self.hift)
        try:
            prompt = self._prompt(prompt_tokens, prompt_feat, embedding)
            for chunk in stream_chunks(tokens, prompt[0].shape[1], lookahead=self.flow.pre_lookahead_len,
                                       schedule=schedule or self.schedule):
                t = self._tokens(chunk.tokens)
                mel = None
                if state is not None:
                    if chunk.final:
                        state.close()
                    else:
                        with torch.inference_mode():
                            mel = incremental_chunk3(self.flow, state, t, *prompt)
                if mel is None:
                    mel = self._mel(t, prompt, streaming=not chunk.final, finalize=chunk.final)
                yield vocode(mel[:, :, chunk.offset * ratio:], final=chunk.final)
        finally:
            if state is not None:
                state.close()
