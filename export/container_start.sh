#!/usr/bin/env bash
# Default command of the Dockerfile.triton image: from a mounted CosyVoice2-0.5B folder, export the ONNX
# graphs, optionally quantise them, build the TensorRT engines for this container's TensorRT and GPU, render the
# model repository and serve it with this image's tritonserver.
#
#   docker run --gpus all -v /path/to/CosyVoice2-0.5B:/models/CosyVoice2-0.5B:ro \
#       -v "$PWD/build:/workspace/build" -e PRECISION=fp16 cosyvoice-triton
#
# Environment: MODEL_DIR (default /models/CosyVoice2-0.5B), PRECISION (fp32|fp16|int8, default fp16),
# BUILD_DIR (default /workspace/build), BUILDER (trtexec|python, default trtexec), REEXPORT=1 to export
# again over existing ONNX files, REQUANTIZE=1 to convert fp16 / int8 again (export/quantize.py;
# CALIBRATION_UTTERANCES default 50, CALIBRATION_METHOD default recorded), QUANTIZE_CMD (a command of your
# own that writes $BUILD_DIR/onnx/int8 or fp16 files instead),
# PYTHON (default python3), SERVE_FLAVOR (trt|onnx|local, default trt), SERVE=0 to stop after the builds,
# RENDER_ARGS (more `model_repository/render.py` arguments, e.g. "--set instances=flow_estimator:2"),
# LM_BACKEND=tensorrtllm (also convert llm.pt, build its TensorRT-LLM engine into $ENGINE_DIR/llm and render the
# tensorrt_llm model; needs TensorRT-LLM, i.e. an image on nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3:
# in this image's base it stops with the reason; README "TensorRT-LLM engine"), MAX_ACTIVE_REQUESTS (its batch, 8),
# COSYVOICE_TRITON_ADMIN_KEY (the key of the restricted APIs; default: random, written to $BUILD_DIR/triton/admin_key),
# SUPERVISOR_MAX_RESTARTS / SUPERVISOR_RESTART_WINDOW (server restarts allowed in a window of seconds, default 5 / 600),
# SUPERVISOR_EXIT_TIMEOUT (on SIGTERM, seconds the requests in flight may take to finish, default 30),
# TRITON_HOST (the address Triton's three ports bind to, default 127.0.0.1: reach it through the gateway in the same
# network namespace, or set 0.0.0.0 together with TRITON_PUBLIC=1 to publish Triton itself, behind a proxy; without
# TRITON_PUBLIC=1 the supervisor refuses an address beyond loopback: docs/operations/hardening.md).
set -euo pipefail

cd "$(dirname "$0")/.."

MODEL_DIR="${MODEL_DIR:-/models/CosyVoice2-0.5B}"
PRECISION="${PRECISION:-fp16}"
BUILD_DIR="${BUILD_DIR:-/workspace/build}"
BUILDER="${BUILDER:-trtexec}"
PYTHON="${PYTHON:-python3}"
ONNX_DIR="$BUILD_DIR/onnx"
ENGINE_DIR="$BUILD_DIR/engines"

case "$PRECISION" in
  fp32|fp16|int8) ;;
  *) echo "error: PRECISION must be fp32, fp16 or int8, got '$PRECISION'" >&2; exit 2 ;;
esac
if [ ! -f "$MODEL_DIR/flow.pt" ]; then
  echo "error: $MODEL_DIR/flow.pt not found: mount a CosyVoice2-0.5B folder there or set MODEL_DIR" >&2
  exit 2
fi

echo "== 1/4 ONNX export: $MODEL_DIR -> $ONNX_DIR/fp32"
if [ "${REEXPORT:-0}" != 1 ] && compgen -G "$ONNX_DIR/fp32/*.onnx" > /dev/null; then
  echo "ONNX files already in $ONNX_DIR/fp32 (REEXPORT=1 to export again)"
else
  "$PYTHON" export/export_onnx.py --model-dir "$MODEL_DIR" --out "$ONNX_DIR/fp32"
fi

echo "== 2/4 reduced precision: $PRECISION"
if [ -n "${QUANTIZE_CMD:-}" ]; then
  bash -c "$QUANTIZE_CMD"
elif [ "$PRECISION" = fp32 ]; then
  echo "fp32: nothing to convert"
elif [ "${REQUANTIZE:-0}" != 1 ] && [ -f "$ONNX_DIR/$PRECISION/manifest.json" ]; then
  echo "$ONNX_DIR/$PRECISION already has graphs (REQUANTIZE=1 to convert again)"
else
  # int8: explicit Q/DQ calibrated on espeak-ng speech run through this checkpoint; fp16: converted graphs.
  "$PYTHON" export/quantize.py --model-dir "$MODEL_DIR" --onnx-root "$ONNX_DIR" --precisions "$PRECISION" \
    --calibration-utterances "${CALIBRATION_UTTERANCES:-50}" --calibration-method "${CALIBRATION_METHOD:-recorded}" \
    --cache-dir "$BUILD_DIR/quantize"
fi

echo "== 3/4 TensorRT engines ($PRECISION, $BUILDER)"
"$PYTHON" export/build_engines.py --onnx-dir "$ONNX_DIR" --engine-dir "$ENGINE_DIR" \
  --precision "$PRECISION" --builder "$BUILDER"

LM_ARGS=""
if [ "${LM_BACKEND:-python}" = tensorrtllm ]; then
  echo "== 3b/4 LM for TensorRT-LLM: $MODEL_DIR/llm.pt -> $BUILD_DIR/llm_hf -> engine in $ENGINE_DIR/llm"
  "$PYTHON" export/convert_llm.py --model-dir "$MODEL_DIR" --out "$BUILD_DIR/llm_hf" --build-engine --require-engine \
    --checkpoint-dir "$BUILD_DIR/trtllm_checkpoint" --engine-dir "$ENGINE_DIR/llm" \
    --max-batch-size "${MAX_ACTIVE_REQUESTS:-8}"
  LM_ARGS="--set lm_backend=tensorrtllm --set max_active_requests=${MAX_ACTIVE_REQUESTS:-8}"
fi

SERVE_FLAVOR="${SERVE_FLAVOR:-trt}"
REPO="$BUILD_DIR/model_repository"
echo "== 4/4 serving: render $REPO (flavor $SERVE_FLAVOR, $PRECISION), start tritonserver"
# shellcheck disable=SC2086  # RENDER_ARGS is a list of arguments
"$PYTHON" model_repository/render.py --flavor "$SERVE_FLAVOR" --out "$REPO" --model-dir "$MODEL_DIR" \
  --onnx-dir "$ONNX_DIR" --engine-dir "$ENGINE_DIR" --precision "$PRECISION" $LM_ARGS ${RENDER_ARGS:-}
if [ "${SERVE:-1}" = 0 ]; then
  echo "SERVE=0: not starting tritonserver; serve with: tritonserver --model-repository=$REPO"
  exit 0
fi
# tritonserver runs under cosyvoice_triton.serving.launch.supervisor: a model whose Python stub dies (Triton 2.51-2.54
# cannot recover one) is unloaded (readiness false) and loaded again; a server that dies is restarted on the same ports,
# at most SUPERVISOR_MAX_RESTARTS times in SUPERVISOR_RESTART_WINDOW s (then it exits 1: give the container a restart
# policy, e.g. `docker run --restart=on-failure` or a Kubernetes Deployment, and point the load balancer's readiness
# probe at GET /v2/health/ready). The administrative APIs (shared memory, model repository, model configs, statistics,
# trace, logging) need the header `cosyvoice-admin-key: <key>` (gRPC: `triton-grpc-protocol-cosyvoice-admin-key`); the
# key is COSYVOICE_TRITON_ADMIN_KEY, else drawn at random at start, and written to $BUILD_DIR/triton/admin_key. README:
# "Hardening: what to put in front of Triton".
# After the load (and after every reload or restart) the supervisor sends one warm-up request through every public
# pipeline, then writes $BUILD_DIR/triton/warm (the Kubernetes startupProbe waits for it). SIGTERM (docker stop,
# a pod's termination): Triton finishes the requests in flight, up to SUPERVISOR_EXIT_TIMEOUT s, then exits.
PUBLIC_TRITON=()
if [ "${TRITON_PUBLIC:-0}" = 1 ]; then PUBLIC_TRITON=(--public-triton); fi
exec "$PYTHON" -m cosyvoice_triton.serving.launch.supervisor --triton-root "${TRITON_ROOT:-/opt/tritonserver}" \
  --model-repository "$REPO" --work-dir "$BUILD_DIR/triton" --host "${TRITON_HOST:-127.0.0.1}" "${PUBLIC_TRITON[@]}" \
  --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
  --max-restarts "${SUPERVISOR_MAX_RESTARTS:-5}" --restart-window "${SUPERVISOR_RESTART_WINDOW:-600}" \
  --exit-timeout "${SUPERVISOR_EXIT_TIMEOUT:-30}"
