"""Clients of the served models.

* :mod:`.client`: the entry point, re-exporting :class:`~.sync_client.CosyVoiceClient` (:mod:`.sync_client`),
  :class:`~.async_client.AsyncCosyVoiceClient` (:mod:`.async_client`) and what they share (:mod:`.wire`).
* :mod:`.live`: live sessions (``cosyvoice_vc_live`` / ``cosyvoice_tts_live``) over a gRPC stream.
* :mod:`.live_ws`: the same live sessions through the gateway's WebSocket routes.
* :mod:`.llm_speech`: an LLM's chat completion stream spoken as it is generated (the gateway's live speech
  socket; its text deltas for :mod:`.live`).
* :mod:`.plain`: the pipeline driven step by step from the client (the load tests' comparison).
* :mod:`.retry`: which failures are retried, and how.
* :mod:`.cli`: ``cosyvoice-triton client`` (vc, tts, speaker, tokens, embedding).
"""
