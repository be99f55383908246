# cosyvoice-triton stage runner. `make help` lists the stages.
# Every target installs what it needs into .venv first; point MODEL_DIR at a real CosyVoice2-0.5B folder
# to run a stage on the real checkpoint instead of the random-weight demo model.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
CLI         := $(VENV)/bin/cosyvoice-triton
DEMO_SIZE   ?= tiny
MODEL_DIR   ?= models/cosyvoice2-demo-$(DEMO_SIZE)
CV3_DIR     ?= models/cosyvoice3-demo-tiny
SOURCE      ?= tests/fixtures/source_en_5s.wav
PROMPT      ?= tests/fixtures/prompt_en_3s.wav
OUT         ?= build/vc_demo.wav
TEXT        ?= Hello! This is CosyVoice 2 served by cosyvoice-triton. 今天天气很好。
PROMPT_TEXT ?=
TTS_OUT     ?= build/tts_demo.wav
OFFICIAL    ?=
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install demo-model vc tts demo test test-unit lint bench bench-core bench-preprocess bench-tts bench-lm-kernels bench-neighbour bench-peer bench-cv3 bench-live-cv3 bench-cv3-graphs bench-served-cv3 quantize-cv3 gpu-wheels \
        export-onnx export quantize quality bench-export engines engines-dry-run convert-llm engines-llm render serve clean

help: ## list the stages
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-16s %s\n", $$1, $$2}'
	@echo "  variables: MODEL_DIR=$(MODEL_DIR) DEMO_SIZE=$(DEMO_SIZE) (tiny|full) SOURCE=... PROMPT=... OUT=..."

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	@# tritonserver 2.51 + its Python backend ship in this wheel; its Python API (and deps) are unused
	$(VENV)/bin/pip install --quiet --no-deps nvidia-pytriton==0.7.0
	touch $@

install: $(VENV)/.installed ## create .venv and install the package with its pinned dependencies

models/cosyvoice2-demo-%/flow.pt: | $(VENV)/.installed
	$(CLI) demo-model --size $* --out models/cosyvoice2-demo-$*

demo-model: $(VENV)/.installed models/cosyvoice2-demo-$(DEMO_SIZE)/flow.pt ## write the random-weight demo model folder (official layout)

vc: $(VENV)/.installed ## in-process voice conversion of SOURCE into the voice of PROMPT with MODEL_DIR
	@if [ ! -f $(MODEL_DIR)/flow.pt ]; then $(MAKE) --no-print-directory demo-model; fi
	$(CLI) vc --model-dir $(MODEL_DIR) --source $(SOURCE) --prompt $(PROMPT) -o $(OUT)

tts: $(VENV)/.installed ## in-process text to speech of TEXT in the voice of PROMPT (PROMPT_TEXT: its transcript) with MODEL_DIR
	@# a demo folder from before TTS existed is rewritten; a real folder is never touched
	@if [ ! -f $(MODEL_DIR)/llm.pt ] && [ "$(MODEL_DIR)" = "models/cosyvoice2-demo-$(DEMO_SIZE)" ]; then \
	  $(CLI) demo-model --size $(DEMO_SIZE) --out $(MODEL_DIR); fi
	$(CLI) tts --model-dir $(MODEL_DIR) --text "$(TEXT)" --prompt-audio $(PROMPT) \
	  $(if $(PROMPT_TEXT),--prompt-text "$(PROMPT_TEXT)") --stream -o $(TTS_OUT)

demo: $(VENV)/.installed ## the main job: demo models, export, Triton, convert the bundled sample and speak a sentence with CosyVoice2 (cosyvoice_vc, cosyvoice_tts) and CosyVoice3 (CV3_DIR; CV3_DIR= : CosyVoice2 only)
	$(CLI) demo --model-dir $(MODEL_DIR) --source $(SOURCE) --prompt $(PROMPT) -o build/vc_served_demo.wav \
	  $(if $(CV3_DIR),--cosyvoice3-dir $(CV3_DIR))

SERVE_FLAVOR ?= local
SERVE_PRECISION ?= fp32
render: $(VENV)/.installed ## render build/model_repository (SERVE_FLAVOR=local|onnx|trt) from model_repository/
	$(CLI) render --flavor $(SERVE_FLAVOR) --model-dir $(MODEL_DIR) --onnx-dir build/onnx --engine-dir build/engines --precision $(SERVE_PRECISION) --out build/model_repository

GATEWAY_PORT ?= 8080
SERVE_RENDERED ?=
serve: $(VENV)/.installed ## serve MODEL_DIR on tritonserver at 127.0.0.1:8000 (http) / 8001 (grpc) / 8002 (metrics), the OpenAI speech gateway at GATEWAY_PORT (0: none); SERVE_FLAVOR, SERVE_PRECISION as for render; SERVE_RENDERED=1: serve build/model_repository as render wrote it
	$(CLI) serve --model-dir $(MODEL_DIR) --gateway-port $(GATEWAY_PORT) --flavor $(SERVE_FLAVOR) --precision $(SERVE_PRECISION) \
	  --onnx-dir build/onnx --repository build/model_repository $(if $(SERVE_RENDERED),--rendered)

test: $(VENV)/.installed ## lint, then run the whole test suite (tests/unit, then tests/live: real tritonserver, gateway, Locust)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-unit: $(VENV)/.installed ## lint, then the tests that start no server (tests/unit): the quick loop
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

lint: $(VENV)/.installed ## ruff
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed ## per-stage timings of in-process VC at full dims (writes the full demo model once)
	@if [ ! -f models/cosyvoice2-demo-full/flow.pt ]; then $(MAKE) --no-print-directory demo-model DEMO_SIZE=full; fi
	$(CLI) bench --model-dir models/cosyvoice2-demo-full

bench-core: bench ## the older name of `make bench`

bench-tts: $(VENV)/.installed ## LM prefill / first token / decode tokens/s at batch 1, 4, 8 and whole-TTS RTF at full dims (OFFICIAL=checkout: side by side)
	$(CLI) bench-tts --model-dir models/cosyvoice2-demo-full $(if $(OFFICIAL),--official $(OFFICIAL))

bench-lm-kernels: $(VENV)/.installed ## the LM's trunk Linears in INT8 through PyTorch, onnxruntime (and OpenVINO if installed: pip install -e ".[openvino]"): ms per step, tokens/s ceiling, distance from fp32
	$(CLI) bench-lm-kernels --model-dir models/cosyvoice2-demo-full --threads 2

BENCH_NEIGHBOUR_ARGS ?=
bench-neighbour: $(VENV)/.installed ## the first streamed TTS chunk (tiny, in process) beside one busy process per CPU: torch's default threads and spinning against the library's choice, interleaved rounds -> build/bench-neighbour.json
	$(CLI) bench-neighbour --model-dir models/cosyvoice2-demo-tiny --json build/bench-neighbour.json $(BENCH_NEIGHBOUR_ARGS)

bench-preprocess: $(VENV)/.installed ## cost of preprocess's optional VAD trim / prompt denoise (5 s source + 3 s prompt)
	$(CLI) bench-preprocess

OFFICIAL_DEPS := build/official-deps
#: the official flow / HiFT imports at the pins of its requirements.txt
OFFICIAL_FLOW_PINS := diffusers==0.29.2 einops==0.8.2 conformer==0.3.2 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 \
  importlib_metadata==10.2.0 zipp==4.1.2
$(OFFICIAL_DEPS)/.installed: | $(VENV)/.installed
	@# the official flow / HiFT imports (its requirements.txt pins), beside the venv, never in it
	$(VENV)/bin/pip install --quiet --no-deps --target $(OFFICIAL_DEPS) $(OFFICIAL_FLOW_PINS)
	touch $@

BENCH_PEER_ARGS ?=
bench-peer: $(VENV)/.installed ## official code vs library vs served (concurrency 1) at full dims: medians, ratios, memory, GFLOP/s vs GEMM ceiling, targets (OFFICIAL=checkout)
ifeq ($(OFFICIAL),)
	@echo "bench-peer: skipped: give OFFICIAL=<checkout of github.com/FunAudioLLM/CosyVoice with its third_party/Matcha-TTS submodule (git clone --recursive)>"
else
	@if [ ! -f models/cosyvoice2-demo-full/flow.pt ]; then $(MAKE) --no-print-directory demo-model DEMO_SIZE=full; fi
	@$(MAKE) --no-print-directory $(OFFICIAL_DEPS)/.installed
	$(CLI) bench-peer --model-dir models/cosyvoice2-demo-full --official $(OFFICIAL) --official-deps $(OFFICIAL_DEPS) $(BENCH_PEER_ARGS)
endif

OFFICIAL_DEPS3 := build/official-deps3
$(OFFICIAL_DEPS3)/.installed: | $(VENV)/.installed
	@# the official CosyVoice3 imports at its requirements.txt pins, beside the venv, never in it; transformers
	@# 4.51.3 (and its tokenizers): the official LM's one-token attention mask decodes other tokens under newer ones
	$(VENV)/bin/pip install --quiet --no-deps --target $(OFFICIAL_DEPS3) $(OFFICIAL_FLOW_PINS) HyperPyYAML==1.2.3 \
	  ruamel.yaml==0.18.17 ruamel.yaml.clib==0.2.15 x-transformers==2.11.24 einx==0.4.3 loguru==0.7.3 frozendict==2.5.1 \
	  transformers==4.51.3 tokenizers==0.21.4
	touch $@

BENCH_LIVE_CV3_ARGS ?=
bench-live-cv3: $(VENV)/.installed ## live CosyVoice3 voice conversion at full dims: compute per chunk as the stream grows, the windowed live path against the official recompute
	@if [ ! -f models/cosyvoice3-demo-full/flow.pt ]; then \
	  $(CLI) demo-model --family cosyvoice3 --size full --out models/cosyvoice3-demo-full; fi
	$(CLI) bench-live-cv3 --model-dir models/cosyvoice3-demo-full $(BENCH_LIVE_CV3_ARGS)

BENCH_CV3_GRAPHS_ARGS ?=
bench-cv3-graphs: $(VENV)/.installed ## CosyVoice3's DiT estimator at full dims: one Euler step in PyTorch and on its ONNX graph (onnxruntime, as served), 1, 2 and 4 utterances padded together
	@if [ ! -f models/cosyvoice3-demo-full/flow.pt ]; then \
	  $(CLI) demo-model --family cosyvoice3 --size full --out models/cosyvoice3-demo-full; fi
	$(CLI) bench-cv3-graphs --model-dir models/cosyvoice3-demo-full $(BENCH_CV3_GRAPHS_ARGS)

BENCH_SERVED_CV3_ARGS ?=
bench-served-cv3: $(VENV)/.installed ## CosyVoice3 through the server at full dims: cosyvoice3_tts_stream's first and later chunks and a cosyvoice3_vc conversion, served over gRPC and in process -> build/bench-served-cv3.json
	$(CLI) bench-served-cv3 --model-dir models/cosyvoice3-demo-full --json build/bench-served-cv3.json $(BENCH_SERVED_CV3_ARGS)

quantize-cv3: $(VENV)/.installed ## CosyVoice3's vocoder graph in CPU INT8 at full dims: export, calibrate on espeak-ng speech, judge against the quality bar and the 1.25x rule -> build/onnx3-full/int8_cpu
	@if [ ! -f models/cosyvoice3-demo-full/flow.pt ]; then \
	  $(CLI) demo-model --family cosyvoice3 --size full --out models/cosyvoice3-demo-full; fi
	$(CLI) export-onnx --model-dir models/cosyvoice3-demo-full --out build/onnx3-full --graphs hift3_decoder --threads 2
	$(CLI) quantize --model-dir models/cosyvoice3-demo-full --onnx-root build/onnx3-full --threads 2

BENCH_CV3_ARGS ?=
FLOW_PRECISION ?= fp32
bench-cv3: $(VENV)/.installed ## CosyVoice3 at full dims, the official code vs the library: token2wav, first streamed chunk, whole TTS, the DiT's share and GFLOP/s vs GEMM ceiling (OFFICIAL=checkout; without: the library alone; FLOW_PRECISION=int8: the library's DiT blocks in INT8)
	@if [ ! -f models/cosyvoice3-demo-full/flow.pt ]; then \
	  $(CLI) demo-model --family cosyvoice3 --size full --out models/cosyvoice3-demo-full; fi
ifneq ($(OFFICIAL),)
	@$(MAKE) --no-print-directory $(OFFICIAL_DEPS3)/.installed
	$(CLI) bench-cv3 --model-dir models/cosyvoice3-demo-full --official $(OFFICIAL) --official-deps $(OFFICIAL_DEPS3) \
	  --flow-precision $(FLOW_PRECISION) $(BENCH_CV3_ARGS)
else
	$(CLI) bench-cv3 --model-dir models/cosyvoice3-demo-full --flow-precision $(FLOW_PRECISION) $(BENCH_CV3_ARGS)
endif

gpu-wheels: $(VENV)/.installed ## PyYAML (CPython 3.10-3.13, x86-64) and cachetools wheels that loadtest/gpu.sh installs on a bare GPU machine -> build/gpu-wheels
	for v in 3.10 3.11 3.12 3.13; do $(VENV)/bin/pip download --quiet --only-binary=:all: --no-deps --platform manylinux2014_x86_64 \
	  --python-version $$v --implementation cp -d build/gpu-wheels pyyaml==6.0.2; done
	$(VENV)/bin/pip download --quiet --only-binary=:all: --no-deps -d build/gpu-wheels cachetools==8.0.2

export-onnx: $(VENV)/.installed ## fp32 ONNX of every graph of MODEL_DIR, each verified against PyTorch with onnxruntime
	@if [ ! -f $(MODEL_DIR)/flow.pt ]; then $(MAKE) --no-print-directory demo-model; fi
	$(CLI) export-onnx --model-dir $(MODEL_DIR) --out build/onnx/fp32

export: export-onnx ## the older name of `make export-onnx`

ONNX_ROOT   ?= build/onnx
CALIBRATION ?= 50
quantize: $(VENV)/.installed ## INT8 Q/DQ (TensorRT), INT8 for CPU and fp16 graphs from ONNX_ROOT/fp32, calibrated on espeak-ng speech
	@if [ ! -f $(ONNX_ROOT)/fp32/flow_estimator.onnx ]; then $(MAKE) --no-print-directory export-onnx; fi
	$(CLI) quantize --model-dir $(MODEL_DIR) --onnx-root $(ONNX_ROOT) --calibration-utterances $(CALIBRATION)

quality: $(VENV)/.installed ## error of each precision against the fp32 pipeline on held-out speech + CPU speed per stage
	@if [ ! -d $(ONNX_ROOT)/int8_cpu ]; then $(MAKE) --no-print-directory quantize; fi
	$(CLI) quality --model-dir $(MODEL_DIR) --onnx-root $(ONNX_ROOT) --out build/quality

FULL_DIR  := models/cosyvoice2-demo-full
FULL_ONNX := build/onnx-full
bench-export: $(VENV)/.installed ## full dims: export, quantize, then fp32 vs fp16/INT8 error and CPU time per stage (long)
	@if [ ! -f $(FULL_DIR)/flow.pt ]; then $(MAKE) --no-print-directory demo-model DEMO_SIZE=full; fi
	@if [ ! -f $(FULL_ONNX)/fp32/flow_estimator.onnx ]; then \
	  $(CLI) export-onnx --model-dir $(FULL_DIR) --out $(FULL_ONNX)/fp32; fi
	@if [ ! -f $(FULL_ONNX)/int8_cpu/hift_decoder.onnx ]; then \
	  $(CLI) quantize --model-dir $(FULL_DIR) --onnx-root $(FULL_ONNX) --calibration-utterances $(CALIBRATION) \
	    --calibration-method recorded --threads 2; fi
	$(CLI) quality --model-dir $(FULL_DIR) --onnx-root $(FULL_ONNX) --threads 2 --out build/quality-full

PRECISION ?= fp16
engines: $(VENV)/.installed ## TensorRT plans from build/onnx (PRECISION=fp32|fp16|int8); needs trtexec: NGC container
	$(CLI) engines --onnx-dir build/onnx --engine-dir build/engines --precision $(PRECISION)

engines-dry-run: $(VENV)/.installed ## print the trtexec commands `make engines` would run
	$(CLI) engines --onnx-dir build/onnx --engine-dir build/engines --precision $(PRECISION) --dry-run

LLM_ENGINE_ARGS ?=
convert-llm: $(VENV)/.installed ## the LM for TensorRT-LLM: merged HF folder build/llm_hf (checked against PyTorch), engine in build/engines/llm (skipped, reason printed, without TensorRT-LLM + GPU)
	@if [ ! -f $(MODEL_DIR)/llm.pt ] && [ "$(MODEL_DIR)" = "models/cosyvoice2-demo-$(DEMO_SIZE)" ]; then \
	  $(CLI) demo-model --size $(DEMO_SIZE) --out $(MODEL_DIR); fi
	$(CLI) convert-llm --model-dir $(MODEL_DIR) --out build/llm_hf --verify --build-engine \
	  --checkpoint-dir build/trtllm_checkpoint --engine-dir build/engines/llm $(LLM_ENGINE_ARGS)

engines-llm: convert-llm ## the older name of `make convert-llm`

.PHONY: loadtest loadtest-full loadtest-tts loadtest-tts-full
LOADTEST_ARGS ?=
loadtest: $(VENV)/.installed ## Locust: plain separate calls vs the integrated ensemble, tiny model, CPU -> build/loadtest/tiny/report.md
	$(CLI) loadtest --config tiny $(LOADTEST_ARGS)

loadtest-full: $(VENV)/.installed ## the same at CosyVoice2-0.5B dims (long; loadtest/README.md) -> build/loadtest/full/report.md
	$(CLI) loadtest --config full $(LOADTEST_ARGS)

loadtest-tts: $(VENV)/.installed ## the TTS column: streaming TTS first chunk + RTF, offline TTS, streaming VC at 1/2/4, perf_analyzer --streaming; tiny -> build/loadtest/tiny-tts/report.md
	$(CLI) loadtest --config tiny --mode tts $(LOADTEST_ARGS)

loadtest-tts-full: $(VENV)/.installed ## the TTS column at CosyVoice2-0.5B dims, short (streaming TTS of one short text and streaming VC, concurrency 1/2, 1 and 2 requests, no perf_analyzer) -> build/loadtest/full-tts-short/report.md
	$(CLI) loadtest --config full --mode tts --tts-columns tts_stream,vc_stream --tts-text "Hi there." \
		--tts-concurrency 1,2 --tts-requests 1 --warmup-requests 0 --perf-protocols "" --max-run-s 900 \
		--startup-timeout-s 900 --server-arg=--backend-config=python,stub-timeout-seconds=600 \
		--out-dir build/loadtest/full-tts-short $(LOADTEST_ARGS)

.PHONY: loadtest-mixed
loadtest-mixed: $(VENV)/.installed ## two tasks on one server: steady high-priority TTS streams under a low-priority VC flood and the reverse, without and with the sharing policy (tiny) -> build/loadtest/tiny-mixed/report.md
	$(CLI) loadtest --config tiny --mode mixed $(LOADTEST_ARGS)

.PHONY: loadtest-prompt-cache
loadtest-prompt-cache: $(VENV)/.installed ## repeated speakers: 4 prompts drawn at random, the integrated pipeline with the prompt caches on vs off in one run (tiny) -> build/loadtest/tiny-prompt-cache/report.md
	$(CLI) loadtest --config tiny --mode prompt-cache --speakers 4 --requests 32 --users 4 \
		--server-arg=--backend-config=python,stub-timeout-seconds=300 $(LOADTEST_ARGS)

.PHONY: loadtest-live bench-live
BENCH_LIVE_ARGS ?=
loadtest-live: $(VENV)/.installed ## live sessions: concurrent live VC streams held at real time (latency p50/p95, margin, underruns at 1/2/4/8), one stream's RTF, live TTS first audio (DEMO_SIZE=full: one stream) -> build/loadtest/$(DEMO_SIZE)-live/report.md
	$(CLI) loadtest-live --config $(DEMO_SIZE) \
		--server-arg=--backend-config=python,stub-timeout-seconds=300 $(BENCH_LIVE_ARGS)

bench-live: loadtest-live ## the older name of `make loadtest-live`

.PHONY: loadtest-live-gateway
loadtest-live-gateway: $(VENV)/.installed ## live VC at 1/2/4 sessions and live TTS over Triton's gRPC and over the gateway's WebSocket, level by level: what the door adds (latency p50/p95, first audio, underruns) -> build/loadtest/$(DEMO_SIZE)-live-gateway/report.md
	$(CLI) loadtest-live --config $(DEMO_SIZE) --via grpc,ws --streams 1,2,4 --whole-sweep \
		--out-dir build/loadtest/$(DEMO_SIZE)-live-gateway \
		--server-arg=--backend-config=python,stub-timeout-seconds=300 $(BENCH_LIVE_ARGS)

.PHONY: bench-server-overhead
BENCH_OVERHEAD_ARGS ?=
bench-server-overhead: $(VENV)/.installed ## what the server adds to the library for the same chunk: the VC and TTS streams and both live models, in process and served over gRPC, p50 first / later chunk, target <= 50 ms added (DEMO_SIZE=full: the real dims, TTS first chunk <= 4 s) -> build/bench-server-overhead/$(DEMO_SIZE).json
	$(CLI) bench-server-overhead --model-dir $(MODEL_DIR) --onnx-dir $(if $(filter full,$(DEMO_SIZE)),build/onnx-full,build/onnx) \
		--work-dir build/bench-server-overhead/$(DEMO_SIZE) --json build/bench-server-overhead/$(DEMO_SIZE).json \
		--server-arg=--backend-config=python,stub-timeout-seconds=600 $(BENCH_OVERHEAD_ARGS)

.PHONY: loadtest-rollout rollout-demo
loadtest-rollout: $(VENV)/.installed ## a rollout under Locust load: stage v2, canary 10/50/100%, rollback, stage + promote (tiny, CPU) -> build/loadtest/rollout/report.md
	$(CLI) loadtest-rollout $(ROLLOUT_ARGS)

rollout-demo: loadtest-rollout ## the older name of `make loadtest-rollout`

.PHONY: prometheus dashboard
prometheus: ## Debian's prometheus + promtool unpacked into build/tools/prometheus (apt-get download + dpkg -x, no install)
	sh deploy/prometheus/fetch-prometheus.sh build/tools/prometheus

dashboard: $(VENV)/.installed ## regenerate deploy/grafana/cosyvoice-triton.json from deploy/grafana/dashboard.py
	$(PY) deploy/grafana/dashboard.py

.PHONY: soak
SOAK_MINUTES ?= 30
SOAK_USERS   ?= 20
soak: $(VENV)/.installed ## (not in CI) SOAK_MINUTES=30 at SOAK_USERS=20 (2x the load tests): 0 failures, < 5% memory growth -> build/soak/report.md
	$(CLI) soak --model-dir $(MODEL_DIR) --minutes $(SOAK_MINUTES) --users $(SOAK_USERS) --out build/soak

.PHONY: loadtest-stress fuzz
STRESS_SECONDS ?= 1800
loadtest-stress: $(VENV)/.installed ## innocent users beside hostile ones (vanishing clients, live sequences without start or end, timeouts) through the gateway for STRESS_SECONDS: 0 failed innocent requests, memory growth < 10% (tiny) -> build/loadtest/tiny-stress/report.md
	$(CLI) loadtest --config tiny --mode stress --stress-seconds $(STRESS_SECONDS) --stress-users 4 \
		--stress-hostile-users 8 --server-arg=--backend-config=python,stub-timeout-seconds=300 $(LOADTEST_ARGS)

FUZZ_EXAMPLES ?= 5000
fuzz: $(VENV)/.installed ## the gateway's fuzz tests long: FUZZ_EXAMPLES fresh examples per property (headers, chunked framing, JSON, multipart, live gRPC frames; no model runs)
	COSYVOICE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/live/test_gateway_fuzz.py -p no:cacheprovider \
		--timeout=0 --durations=0

clean: ## remove build outputs (keeps .venv and models/)
	rm -rf build .pytest_cache .ruff_cache
