"""Serving on Triton, in three subpackages and one shared file:

* :mod:`.stages`: the library the ``model.py`` adapters and BLS orchestrators call inside Triton (no Triton import).
* :mod:`.repository`: the render of the served model repository from ``model_repository/`` and ``ensemble/``.
* :mod:`.launch`: starting, supervising, warming up and rolling out a ``tritonserver``.
* :mod:`.marker`: the marker file of a rendered repository, written by the render and read by the launchers.
"""
