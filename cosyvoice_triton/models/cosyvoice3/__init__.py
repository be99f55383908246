"""CosyVoice3 (the released Fun-CosyVoice3 folder: ``cosyvoice3.yaml``), beside CosyVoice2: its LM
(``CosyVoice3LM``), its DiT flow (``CausalMaskedDiffWithDiT``) and its causal vocoder (``CausalHiFTGenerator``),
each equal to the official code on random weights in the official format; and the token -> waveform path that joins
the flow and the vocoder as the official ``CosyVoice3Model`` does, streaming included (``Token2Wav3``)."""
