# cosyvoice-triton stage runner. `make help` lists the stages.
# Every target installs what it needs into .venv first; point MODEL_DIR at a real CosyVoice2-0.5B folder
# to run a stage on the real checkpoint instead of the random-weight demo model.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
DEMO_SIZE   ?= tiny
MODEL_DIR   ?= models/cosyvoice2-demo-$(DEMO_SIZE)
SOURCE      ?= tests/fixtures/source_en_5s.wav
PROMPT      ?= tests/fixtures/prompt_en_3s.wav
OUT         ?= build/vc_demo.wav
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install demo-model vc demo test lint bench-core export engines engines-dry-run render serve clean

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
	$(PY) -m cosyvoice_triton demo-model --size $* --out models/cosyvoice2-demo-$*

demo-model: $(VENV)/.installed models/cosyvoice2-demo-$(DEMO_SIZE)/flow.pt ## write the random-weight demo model folder (official layout)

vc: $(VENV)/.installed ## in-process voice conversion of SOURCE into the voice of PROMPT with MODEL_DIR
	@if [ ! -f $(MODEL_DIR)/flow.pt ]; then $(MAKE) --no-print-directory demo-model; fi
	$(PY) -m cosyvoice_triton vc --model-dir $(MODEL_DIR) --source $(SOURCE) --prompt $(PROMPT) -o $(OUT)

demo: $(VENV)/.installed ## the main job: demo model, export, Triton, convert the bundled sample through cosyvoice_vc
	$(PY) -m cosyvoice_triton.serve_demo demo --model-dir $(MODEL_DIR) --source $(SOURCE) --prompt $(PROMPT) -o build/vc_served_demo.wav

SERVE_FLAVOR ?= local
SERVE_PRECISION ?= fp32
render: $(VENV)/.installed ## render build/model_repository (SERVE_FLAVOR=local|onnx|trt) from model_repository/
	$(PY) model_repository/render.py --flavor $(SERVE_FLAVOR) --model-dir $(MODEL_DIR) --onnx-dir build/onnx --engine-dir build/engines --precision $(SERVE_PRECISION) --out build/model_repository

serve: $(VENV)/.installed ## serve MODEL_DIR on tritonserver at 127.0.0.1:8000 (http) / 8001 (grpc) / 8002 (metrics)
	$(PY) -m cosyvoice_triton.serve_demo serve --model-dir $(MODEL_DIR)

test: $(VENV)/.installed ## lint, then run the test suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed ## ruff
	$(VENV)/bin/ruff check .

bench-core: $(VENV)/.installed ## per-stage timings of in-process VC at full dims (writes the full demo model once)
	@if [ ! -f models/cosyvoice2-demo-full/flow.pt ]; then $(MAKE) --no-print-directory demo-model DEMO_SIZE=full; fi
	$(PY) -m cosyvoice_triton bench --model-dir models/cosyvoice2-demo-full

export: $(VENV)/.installed ## fp32 ONNX of every graph of MODEL_DIR, each verified against PyTorch with onnxruntime
	@if [ ! -f $(MODEL_DIR)/flow.pt ]; then $(MAKE) --no-print-directory demo-model; fi
	$(PY) export/export_onnx.py --model-dir $(MODEL_DIR) --out build/onnx/fp32

PRECISION ?= fp16
engines: $(VENV)/.installed ## TensorRT plans from build/onnx (PRECISION=fp32|fp16|int8); needs trtexec: NGC container
	$(PY) export/build_engines.py --onnx-dir build/onnx --engine-dir build/engines --precision $(PRECISION)

engines-dry-run: $(VENV)/.installed ## print the trtexec commands `make engines` would run
	$(PY) export/build_engines.py --onnx-dir build/onnx --engine-dir build/engines --precision $(PRECISION) --dry-run

clean: ## remove build outputs (keeps .venv and models/)
	rm -rf build .pytest_cache .ruff_cache
