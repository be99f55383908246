"""A stand-in for the gRPC side of the gateway's KServe proxy in process: the servicer context a request arrives
with (a tenant's key; ``codes``: the client asked for Triton's error codes), and a whole stream through a proxy's
``ModelStreamInfer``."""

from __future__ import annotations


class Context:
    def __init__(self, key, codes=False):
        self.key, self.codes, self.aborted = key, codes, None

    def invocation_metadata(self):
        return (("authorization", f"Bearer {self.key}"),) + ((("triton_grpc_error", "true"),) if self.codes else ())

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


async def stream_through(proxy, key, requests) -> list:
    """Every answer of ``proxy.ModelStreamInfer`` to ``requests`` sent in one stream with ``key``."""
    async def each():
        for r in requests:
            yield r
    return [a async for a in proxy.ModelStreamInfer(each(), Context(key))]
