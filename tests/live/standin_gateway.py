"""The real gateway (``create_app`` on uvicorn with h11, as ``python -m cosyvoice_triton.gateway`` runs it, its
KServe gRPC port on) in front of a stand-in Triton: no model runs, so hostile input can be thrown at the door by
the thousand. Run as ``python standin_gateway.py HTTP_PORT GRPC_PORT KEY...`` (each key its own tenant).

The stand-in Triton answers on both of Triton's ports, on loopback, in threads of this process:

* gRPC (``GRPCInferenceService``): live, ready, server and model metadata (each public model's inputs and outputs
  as the rendered repository declares them, :data:`~cosyvoice_triton.serving.repository.served.SERVED_MODELS`),
  ``ModelInfer`` (one zero sample per output) and ``ModelStreamInfer`` with the sequence batcher's rules as far as
  ids go: a start opens an id, a piece on an id never started is refused naming it (Triton's message), an end
  closes it; each request one answer, then the empty final response when asked for.
* HTTP (``/v2``): health, metadata, and ``infer`` answered with an empty output list.

The speech routes (``/v1/audio/speech``, the form routes, voices) run on a stand-in speech backend: a few frames of
silence, an in-memory voice table."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

DATATYPES = {"float32": "FP32", "int32": "INT32", "int64": "INT64", "uint64": "UINT64", "bool": "BOOL",
             "bytes": "BYTES"}
START_REFUSED = ("inference request for sequence {sid} to model '{model}' must specify the START flag on the first "
                 "request of the sequence")


def metadata() -> dict[str, dict]:
    """Each public model's KServe metadata, as Triton gives it for the rendered repository."""
    from cosyvoice_triton.gateway.config import KSERVE_MODELS
    from cosyvoice_triton.serving.repository.served import SERVED_MODELS

    out = {}
    for m in SERVED_MODELS:
        if m.name not in KSERVE_MODELS:
            continue

        def entry(t):
            dims = [d if isinstance(d, int) else -1 for d in t.shape[1:]] or [1]
            return {"name": t.name, "datatype": DATATYPES[t.dtype], "shape": [-1, *dims]}

        out[m.name] = {"name": m.name, "versions": ["1"], "platform": "python",
                       "inputs": [entry(t) for t in m.inputs], "outputs": [entry(t) for t in m.outputs]}
    return out


class StandInTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: dict[str, dict]):
        self.models = models
        self.live: set = set()
        self.lock = threading.Lock()

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="triton", version="2.51.0")

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in self.models)

    def ModelMetadata(self, request, context):
        meta = self.models.get(request.name)
        if meta is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.name}' is not found")
        answer = service_pb2.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                                   platform=meta["platform"])
        for kind in ("inputs", "outputs"):
            for t in meta[kind]:
                getattr(answer, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return answer

    def _answer(self, request) -> service_pb2.ModelInferResponse:
        out = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for t in self.models.get(request.model_name, {}).get("outputs", ()):
            out.outputs.add(name=t["name"], datatype=t["datatype"], shape=[1, 1])
            out.raw_output_contents.append(b"\0" * (8 if t["datatype"] in ("INT64", "FP64") else 4))
        return out

    def ModelInfer(self, request, context):
        return self._answer(request)

    def ModelStreamInfer(self, request_iterator, context):
        for req in request_iterator:
            p = req.parameters.get("sequence_id")
            sid = getattr(p, p.WhichOneof("parameter_choice")) if p is not None and p.WhichOneof(
                "parameter_choice") else 0
            start = req.parameters.get("sequence_start")
            end = req.parameters.get("sequence_end")
            with self.lock:
                if sid and start is not None and start.bool_param:
                    self.live.add((req.model_name, sid))
                elif sid and (req.model_name, sid) not in self.live:
                    yield service_pb2.ModelStreamInferResponse(
                        error_message=START_REFUSED.format(sid=sid, model=req.model_name))
                    continue
                if sid and end is not None and end.bool_param:
                    self.live.discard((req.model_name, sid))
            answer = service_pb2.ModelStreamInferResponse(infer_response=self._answer(req))
            answer.infer_response.parameters["triton_final_response"].bool_param = False
            yield answer
            asked = req.parameters.get("triton_enable_empty_final_response")
            if asked is not None and asked.bool_param:
                final = service_pb2.ModelStreamInferResponse(
                    infer_response=service_pb2.ModelInferResponse(model_name=req.model_name, id=req.id))
                final.infer_response.parameters["triton_final_response"].bool_param = True
                yield final


def http_handler(models: dict[str, dict]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            parts = self.path.strip("/").split("/")
            if parts[:2] == ["v2", "health"] or parts == ["v2"]:
                return self._send(200, {"name": "triton", "version": "2.51.0"} if parts == ["v2"] else {})
            if len(parts) >= 3 and parts[1] == "models" and parts[2] in models:
                return self._send(200, {"ready": True} if parts[-1] == "ready" else models[parts[2]])
            self._send(404, {"error": f"unknown path {self.path[:100]}"})

        def do_POST(self):
            n = int(self.headers.get("content-length") or 0)
            self.rfile.read(n)
            parts = self.path.strip("/").split("/")
            model = parts[2] if len(parts) >= 3 else ""
            self._send(200, {"model_name": model, "model_version": "1", "outputs": []})

    return Handler


class Backend:
    """The speech backend: a few frames of silence for every job, the voices in a dict."""

    def __init__(self):
        self.table: dict[str, float] = {}

    async def ready(self):
        return True

    async def synthesize(self, job, request_id=""):
        return np.zeros(2400, np.float32), 24000

    async def stream(self, job, request_id=""):
        for _ in range(2):
            yield np.zeros(2400, np.float32), 24000

    convert_stream = stream

    async def voices(self):
        return list(self.table)

    async def voice_seconds(self, voice):
        return self.table.get(voice, 0.0)

    async def register_voice(self, voice, wave, sample_rate, text):
        self.table[voice] = len(wave) / sample_rate

    async def delete_voice(self, voice):
        self.table.pop(voice, None)

    async def close(self):
        pass


@contextlib.contextmanager
def served_in_thread(app, **config):
    """``app`` on uvicorn (h11) on a free loopback port, in a thread of this process: yields the port; the server
    stops on the way out. ``config``: more of ``uvicorn.Config`` (``lifespan``, ...)."""
    import uvicorn
    from conftest import wait_until

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http="h11", log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the uvicorn server to start")
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


def main(argv: list[str]) -> None:
    import uvicorn

    from cosyvoice_triton.gateway import GatewayConfig, create_app

    port, grpc_port, keys = int(argv[0]), int(argv[1]), argv[2:]
    models = metadata()
    triton_grpc = grpc.server(futures.ThreadPoolExecutor(8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(StandInTriton(models), triton_grpc)
    triton_grpc_port = triton_grpc.add_insecure_port("127.0.0.1:0")
    triton_grpc.start()
    triton_http = ThreadingHTTPServer(("127.0.0.1", 0), http_handler(models))
    threading.Thread(target=triton_http.serve_forever, daemon=True).start()
    config = GatewayConfig(port=port, grpc_port=grpc_port, api_keys=frozenset(keys),
                           triton_grpc=f"127.0.0.1:{triton_grpc_port}",
                           triton_http=f"127.0.0.1:{triton_http.server_address[1]}")
    uvicorn.run(create_app(config, Backend()), host="127.0.0.1", port=port, http="h11", log_level="warning",
                lifespan="on")


if __name__ == "__main__":
    main(sys.argv[1:])
