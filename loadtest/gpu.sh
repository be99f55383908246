#!/usr/bin/env bash
# GPU figures, two modes (each sized to finish in under 8 minutes on a data-centre GPU):
#
#   loadtest/gpu.sh                    MODE=bench (default): the seed's scenario on a BARE GPU machine, no Triton:
#                                      python -m cosyvoice_triton.bench.gpu, two parts at full dims (random weights):
#                                      1. voice conversion: 10 concurrent 5 s conversions, batched against one at a
#                                         time, fp32 / bf16 / fp16: latency, throughput, peak GPU memory;
#                                      2. streaming text to speech: the LM, flow and HiFT on the GPU, 1, 4 and 10
#                                         requests at once (decoded together), fp32 / bf16: first-chunk latency
#                                         p50 / max and its parts (prefill, first hop's tokens, flow, HiFT), total
#                                         time, RTF, peak GPU memory
#                                      -> $OUT_DIR/report.md (build/loadtest/gpu-bench)
#   DRY_RUN=1 loadtest/gpu.sh          the same on the CPU at tiny dims, 2 requests, TTS at 1 and 2 at once
#                                      (checks the set-up here)
#   MODE=triton loadtest/gpu.sh        the Triton load test below (needs `make install` with a CUDA torch)
#
# MODE=bench needs python3 with torch (a CUDA build), numpy (1 or 2) and, for the TTS part, transformers (4.5x or
# 5.x; without it the report says the TTS part did not run and the voice-conversion figures stand). PyYAML and
# cachetools, which the package imports, are installed from the wheels in $WHEELS (build/gpu-wheels: `make
# gpu-wheels` fills it, ~1 MB; carry that folder) into $OUT_DIR/site when the interpreter lacks them; the audio
# front end's packages are not needed (the bench feeds token ids and features directly). Nothing is downloaded.
# Time: the voice-conversion part starts no scenario after VC_TIME_LIMIT_S (180 s), the TTS part none after
# TIME_LIMIT_S - 60 s; each prints its progress. PARTS=vc or PARTS=tts runs one part. Triton itself is not part of
# MODE=bench: the tritonserver wheel (nvidia-pytriton, ~100 MB+) does not fit the 64 MiB that can be carried.
#
# MODE=triton: the load-test comparison on one CUDA GPU, for machines without TensorRT or onnxruntime-gpu: both
# columns serve the four neural graphs (flow encoder/estimator, HiFT source/decoder) as the checkpoint's PyTorch
# modules on CUDA inside Triton's Python backend (tunables runtime=torch, device=cuda); the shipped speech tokenizer
# and speaker encoder stay on onnxruntime on the CPU, as does the audio front end. The integrated column keeps
# dynamic batching; the plain column is the `plain` profile (no dynamic batching) called stage by stage by the
# client.
#
#   MODE=triton loadtest/gpu.sh                 # full dims (CosyVoice2-0.5B), report in build/loadtest/gpu/report.md
#   MODE=triton CONFIG=tiny loadtest/gpu.sh     # the tiny demo model
#   MODE=triton DRY_RUN=1 loadtest/gpu.sh       # no GPU needed: prepare, render both repositories, print the runs
#
# Needs: `make install` done with a CUDA build of torch (the pinned torch==2.13.0 from PyPI is one on Linux x86-64)
# and an NVIDIA driver (nvidia-smi). Every Locust run stops after its requests or MAX_RUN_S seconds, whichever comes
# first (a capped run is named in the report's notes), and the whole script is cut at TIME_LIMIT_S. nvidia-smi
# samples the device's memory every 500 ms into $OUT_DIR/nvidia-smi.csv; its peak is appended to the report next to
# the sampler's per-run figures. Instance kind: flavor `local` renders KIND_CPU instances; with device=cuda each
# Python stub places its module on the current CUDA device (cuda:0 on a one-GPU machine), which is what this is for.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${MODE:-bench}
DRY_RUN=${DRY_RUN:-0}
TIME_LIMIT_S=${TIME_LIMIT_S:-470}

if [ "$MODE" = bench ]; then
  if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  OUT_DIR=${OUT_DIR:-build/loadtest/gpu-bench}
  WHEELS=${WHEELS:-build/gpu-wheels}
  mkdir -p "$OUT_DIR"
  missing=()
  "$PY" -c "import yaml" 2>/dev/null || missing+=(pyyaml)
  "$PY" -c "import cachetools" 2>/dev/null || missing+=(cachetools)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "loadtest/gpu.sh: installing ${missing[*]} from $WHEELS into $OUT_DIR/site (no index)"
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$OUT_DIR/site" "${missing[@]}"
    export PYTHONPATH="$PWD/$OUT_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ "$DRY_RUN" = 1 ]; then
    exec "$PY" -m cosyvoice_triton.bench.gpu --size tiny --device cpu --requests "${REQUESTS:-2}" --seconds 1 \
      --prompt-seconds 1 --parts "${PARTS:-vc,tts}" --tts-concurrency "${TTS_CONCURRENCY:-1,2}" --tts-seconds 2 \
      --tts-precisions "${TTS_PRECISIONS:-fp32,bf16}" --time-limit-s "$TIME_LIMIT_S" \
      --vc-time-limit-s "${VC_TIME_LIMIT_S:-$TIME_LIMIT_S}" --out-dir "$OUT_DIR"
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  exec timeout --signal=INT --kill-after=30 "$TIME_LIMIT_S" "$PY" -m cosyvoice_triton.bench.gpu --device cuda \
    --requests "${REQUESTS:-10}" --seconds "${SECONDS_PER_REQUEST:-5}" --precisions "${PRECISIONS:-fp32,bf16,fp16}" \
    --parts "${PARTS:-vc,tts}" --tts-concurrency "${TTS_CONCURRENCY:-1,4,10}" \
    --tts-precisions "${TTS_PRECISIONS:-fp32,bf16}" --tts-seconds "${TTS_SECONDS:-5}" \
    --time-limit-s "$(( TIME_LIMIT_S - 60 ))" --vc-time-limit-s "${VC_TIME_LIMIT_S:-180}" --out-dir "$OUT_DIR"
fi
if [ "$MODE" != triton ]; then
  echo "loadtest/gpu.sh: MODE must be bench or triton, got $MODE" >&2
  exit 2
fi

PY=${PY:-.venv/bin/python}
CONFIG=${CONFIG:-full}
OUT_DIR=${OUT_DIR:-build/loadtest/gpu}
REQUESTS=${REQUESTS:-100}
SWEEP_REQUESTS=${SWEEP_REQUESTS:-8}
PERF_REQUESTS=${PERF_REQUESTS:-10}
MAX_RUN_S=${MAX_RUN_S:-40}

args=(--config "$CONFIG" --device cuda --out-dir "$OUT_DIR" --requests "$REQUESTS" --sweep-requests "$SWEEP_REQUESTS"
      --perf-requests "$PERF_REQUESTS" --max-run-s "$MAX_RUN_S" --startup-timeout-s 240)

if [ "$DRY_RUN" = 1 ]; then
  exec "$PY" loadtest/run.py "${args[@]}" --dry-run
fi

if ! command -v nvidia-smi >/dev/null; then
  echo "loadtest/gpu.sh: no nvidia-smi here: this script needs an NVIDIA GPU (DRY_RUN=1 checks the set-up)" >&2
  exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "loadtest/gpu.sh: $PY's torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)'))." >&2
  echo "  Install a CUDA build of torch into the venv (on Linux x86-64 PyPI's torch==2.13.0 is one)." >&2
  exit 3
fi
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 500 \
  > "$OUT_DIR/nvidia-smi.csv" &
smi=$!
trap 'kill "$smi" 2>/dev/null || true' EXIT

start=$(date +%s)
status=0
timeout --signal=INT --kill-after=30 "$TIME_LIMIT_S" "$PY" loadtest/run.py "${args[@]}" || status=$?
kill "$smi" 2>/dev/null || true
wait "$smi" 2>/dev/null || true

peak=$(awk -F', *' '$2+0 > m {m = $2+0} END {print m+0}' "$OUT_DIR/nvidia-smi.csv")
util=$(awk -F', *' '{s += $3; n++} END {if (n) printf "%.0f", s/n; else print "n/a"}' "$OUT_DIR/nvidia-smi.csv")
summary="GPU: $(head -1 "$OUT_DIR/gpu.txt"); peak device memory over the whole script (nvidia-smi, every 500 ms): ${peak} MiB; mean GPU utilisation ${util}%; $(( $(date +%s) - start )) s"
echo "$summary"
if [ -f "$OUT_DIR/report.md" ]; then
  printf '\n## GPU (loadtest/gpu.sh)\n\n%s\n' "$summary" >> "$OUT_DIR/report.md"
fi
exit "$status"
