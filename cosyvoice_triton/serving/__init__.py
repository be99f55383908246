"""The served pipeline's library: everything the Triton ``model.py`` adapters call, with no Triton import.

Each ``model_repository/<model>/model.py`` turns request tensors into numpy arrays, makes ONE call into a class
here for all the requests of an ``execute()``, and turns the result back into responses. Everything is
therefore tested in-process (``tests/test_serving_stages.py``); :class:`~.local.LocalPipeline` composes the
stages exactly as the ``cosyvoice_vc`` ensemble does, without a server.

* :mod:`.params`: typed tunables read once from a model config's ``parameters``.
* :mod:`.batching`: pad / group / split helpers and :class:`~.batching.ItemResult` (a value or an error per request).
* :mod:`.graphs`: :class:`~.graphs.GraphRunner`, one exported graph on onnxruntime (or its PyTorch module),
  batching requests of different lengths exactly (padding where the graph is padding-invariant, equal-length
  groups where it is not).
* :mod:`.frontend`: :class:`~.frontend.Preprocessor`, validation, resampling and the three features.
* :mod:`.flow`: :class:`~.flow.FlowSolver`, the flow encoder call and the Euler solver for a batch of utterances.
* :mod:`.vocoder`: :class:`~.vocoder.HiftRunner`, seeded NSF noise and the two HiFT graphs.
* :mod:`.postprocess`: :class:`~.postprocess.Postprocessor`, output rate, loudness, encoded bytes.
"""
