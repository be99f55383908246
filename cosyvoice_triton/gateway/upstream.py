"""Triton behind the KServe entry points: its gRPC stub and HTTP session (both on loopback), and each public
model's :class:`~.inference.Signature`, read from Triton's model metadata and kept a few seconds (a model
reloaded with other inputs is seen soon after)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ..errors import shown
from .errors import GatewayError
from .inference import Signature

#: How long a model's signature is reused before Triton is asked again.
SIGNATURE_TTL_S = 5.0


class Upstream:
    def __init__(self, grpc_url: str, http_url: str, models: tuple[str, ...], *, timeout_s: float,
                 max_message_bytes: int):
        self.grpc_url, self.http_url, self.models, self.timeout_s = grpc_url, http_url, frozenset(models), timeout_s
        self.max_message_bytes = max_message_bytes
        self.channel: grpc.aio.Channel | None = None
        self.stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self.session: aiohttp.ClientSession | None = None
        self._signatures: dict[str, tuple[float, Signature]] = {}
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        # the answer may be larger than what a client may send (whole waveforms): no receive limit upstream
        self.channel = grpc.aio.insecure_channel(self.grpc_url, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", self.max_message_bytes * 2)])
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.session = aiohttp.ClientSession(f"http://{self.http_url}",
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                             headers={"accept-encoding": "identity"}, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.channel is not None:
            await self.channel.close()

    def public(self, model: str) -> str:
        if model not in self.models:
            raise GatewayError(404, f"model {shown(model)} is not served at this entry point; served: "
                               f"{', '.join(sorted(self.models))}", code="model_not_found")
        return model

    async def signature(self, model: str) -> Signature:
        self.public(model)
        now = time.monotonic()
        hit = self._signatures.get(model)
        if hit is not None and now - hit[0] < SIGNATURE_TTL_S:
            return hit[1]
        async with self._lock:
            try:
                answer = await self.stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model),
                                                       timeout=min(self.timeout_s, 30.0))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                    raise GatewayError(404, f"model {model!r} is not loaded: {exc.details()}",
                                       code="model_not_found") from None
                raise GatewayError(503, f"Triton did not answer for model {model!r}: {exc.details()}",
                                   code="backend_unavailable") from None
            sig = Signature.from_metadata(MessageToDict(answer, preserving_proto_field_name=True))
            self._signatures[model] = (time.monotonic(), sig)
            return sig
