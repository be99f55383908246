"""CosyVoice3's token-to-wav over a sliding window, for streams of any length (live voice conversion).

The official streaming ``token2wav`` (:class:`~.token2wav.Token2Wav3`) runs the flow on every token so far and the
vocoder on every mel frame so far at each chunk: the cost of a chunk grows with the stream, and so does the memory.
A live stream has no end to plan for, so here both run on a bounded window:

- the vocoder on :class:`~.vocoder_window.VocoderWindow` (its samples equal the official recompute's up to float
  rounding, at a cost per chunk that does not grow);
- :class:`Token2Wav3Window`: the flow on the prompt and a window of source tokens (the caller's: it chooses how
  many tokens before the chunk's first to keep), each frame with the official fixed noise of its place in the whole
  stream. The DiT's attention is chunk-causal (25 tokens) in streaming mode and its convolution causal, so a window
  that still starts at the first source token computes exactly the official frames; once the window slides, the
  frames see only the window's tokens before them (and the prompt), a bounded approximation of the official
  whole-stream attention, as CosyVoice2's live conversion.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import CosyVoiceError
from .token2wav import Token2Wav3
from .vocoder_window import VOCODER_CONTEXT_FRAMES, NoiseWindow, VocoderWindow

__all__ = ["VOCODER_CONTEXT_FRAMES", "NoiseWindow", "Token2Wav3Window", "VocoderWindow"]


class Token2Wav3Window:
    """One stream's flow + vocoder over a sliding token window (module docstring).

    :meth:`step` is one chunk: ``tokens`` the window (every source token the flow sees, the 3 look-ahead tokens
    included unless ``final``), ``offset`` where the chunk's new tokens start in it. The window's place in the
    stream follows from what earlier steps produced. The flow and vocoder are ``token2wav``'s, the prompt as its
    methods take it (and checked as they check it); outputs float32 audio at 24 kHz.
    """

    def __init__(self, token2wav: Token2Wav3, prompt_tokens, prompt_feat, embedding, *,
                 vocoder_context_frames: int = VOCODER_CONTEXT_FRAMES, seed: int | None = None):
        self.flow, self.device = token2wav.flow, token2wav.device
        self.prompt_tokens, self.prompt_feat, self.embedding = token2wav._prompt(prompt_tokens, prompt_feat,
                                                                                 embedding)
        self.vocoder = VocoderWindow(token2wav.hift, context_frames=vocoder_context_frames, seed=seed)
        self.ratio, self.lookahead = self.flow.token_mel_ratio, self.flow.pre_lookahead_len
        self.produced = 0  # source tokens whose mel has been produced

    def _noise(self, start: int, frames: int) -> torch.Tensor:
        """The official fixed noise of the prompt's frames and of ``frames`` frames from source token ``start`` on
        (the buffer repeats past its end, 300 s, where the official code stops)."""
        buf = self.flow.decoder.rand_noise
        prompt = self.prompt_tokens.shape[1] * self.ratio
        at = torch.cat([torch.arange(prompt), prompt + start * self.ratio + torch.arange(frames)])
        return buf[:, :, at % buf.shape[-1]]

    @torch.inference_mode()
    def step(self, tokens, offset: int, *, final: bool) -> np.ndarray:
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.int32, device=self.device).reshape(1, -1)
        lookahead = 0 if final else self.lookahead
        if t.shape[1] - lookahead <= offset:
            raise CosyVoiceError(f"a chunk of {t.shape[1]} tokens with {lookahead} look-ahead has no new token "
                                 f"after {offset}")
        if int(t.max()) >= self.flow.dims.vocab_size or int(t.min()) < 0:
            raise CosyVoiceError(f"speech token out of range [0, {self.flow.dims.vocab_size})")
        start = self.produced - int(offset)
        if start < 0:
            raise ValueError(f"offset {offset}: only {self.produced} tokens were produced before this chunk")
        frames = (t.shape[1] - lookahead) * self.ratio
        mel, _ = self.flow.inference(t, self.prompt_tokens, self.prompt_feat, self.embedding, streaming=not final,
                                     finalize=final, noise=self._noise(start, frames).to(self.device))
        self.produced += t.shape[1] - lookahead - int(offset)
        return self.vocoder(mel[:, :, int(offset) * self.ratio:], final=final)

    def close(self) -> None:
        """Nothing to free beyond this object (the torch tensors go with it); for the session's interface."""
