"""The served pipeline's library: everything the Triton ``model.py`` adapters call, with no Triton import.

Each ``model_repository/<model>/model.py`` turns request tensors into numpy arrays, makes ONE call into a class
here for all the requests of an ``execute()``, and turns the result back into responses. Everything is
therefore tested in-process (``tests/unit/test_serving_stages.py``); :class:`~.local.LocalPipeline` composes the
stages exactly as the ``cosyvoice_vc`` ensemble does, without a server.

* :mod:`.params`: typed tunables read once from a model config's ``parameters``.
* :mod:`.model_params`: the ``parameters`` each served model reads (one declaration for the render and the adapters).
* :mod:`.triton_io`: what every adapter needs from Triton's ``pb`` (tensors, errors, BLS calls).
* :mod:`.batching`: pad / group / split helpers and :class:`~.batching.ItemResult` (a value or an error per request).
* :mod:`.graphs`: :class:`~.graphs.GraphRunner`, one exported graph on onnxruntime (or its PyTorch module),
  batching requests of different lengths exactly (padding where the graph is padding-invariant, equal-length
  groups where it is not).
* :mod:`.frontend`: :class:`~.frontend.Preprocessor`, validation, resampling and the three features.
* :mod:`.enhance`: optional VAD trim and prompt denoising of ``preprocess``.
* :mod:`.flow`: :class:`~.flow.FlowSolver`, the flow encoder call and the Euler solver for a batch of utterances.
* :mod:`.vocoder`: :class:`~.vocoder.HiftRunner`, seeded NSF noise and the two HiFT graphs.
* :mod:`.postprocess`: :class:`~.postprocess.Postprocessor`, output rate, loudness, encoded bytes.
* :mod:`.local`: :class:`~.local.LocalPipeline`, the ``cosyvoice_vc`` ensemble in process.
* :mod:`.speakers`: the ``speakers`` model (register, get, list, delete).
* :mod:`.vc_stream`: streaming token-to-wav and ``cosyvoice_vc_stream``.
* :mod:`.lm_engine`: the in-flight batched LM decode loop.
* :mod:`.tts`: the served TTS (``cosyvoice_tts_stream``, ``cosyvoice_tts``).
* :mod:`.official_api`: ``cosyvoice2``, the official runtime's interface.
* :mod:`.live`: sessions of the live (sequence-batched, decoupled) models.
* :mod:`.live_vc`: ``cosyvoice_vc_live``, live voice conversion.
* :mod:`.live_tts`: ``cosyvoice_tts_live``, live text to speech.
* :mod:`.metrics`: the stages' speech metrics through Triton's custom metrics API.
"""
