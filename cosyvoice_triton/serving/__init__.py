"""Serving on Triton, in three subpackages and three shared files:

* :mod:`.stages`: the library the ``model.py`` adapters and BLS orchestrators call inside Triton (no Triton import).
* :mod:`.repository`: the render of the served model repository from ``model_repository/`` and ``ensemble/``.
* :mod:`.launch`: starting, supervising, warming up and rolling out a ``tritonserver``.
* :mod:`.marker`: the marker file of a rendered repository, written by the render and read by the launchers.
* :mod:`.versioning`: what a numbered version is (:class:`~.versioning.VersionSpec`, its pipeline, its manifest),
  rendered by :mod:`.repository` and rolled out by :mod:`.launch`.
* :mod:`.samples`: the Python stages' warm-up inputs, rendered into their configs and sent by the launchers.

:mod:`.launch` imports :mod:`.repository`, never the other way round (``tests/unit/test_imports.py``).
"""
