"""Launching and operating a ``tritonserver`` on a rendered repository.

* :mod:`.server`: :class:`~.server.TritonServer`, the wheel's (or an image's) ``tritonserver`` without Docker.
* :mod:`.supervisor`: keeps it serving (dead stubs reloaded, a dead server restarted); the container's entry point.
* :mod:`.warmup`: one real request through every public pipeline after a load.
* :mod:`.rollout`: numbered versions and the router's traffic split on a running server.
* :mod:`.serve`: production serving in the foreground (``cosyvoice-triton serve``): prepare, render, supervise.
* :mod:`.serve_demo`: the served demo end to end (``cosyvoice-triton demo``).
"""
