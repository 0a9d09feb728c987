# g4rt: everything a newcomer or CI needs goes through these targets.
# `make run` and `make test` each create or refresh the virtualenv they need.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch 2.13.0 lies on this project's machines; GPU-only packages are in the `gpu` extra.
TORCH   ?= torch==2.13.0
MODEL   ?= tiny
PROMPT  ?= Gemma 4 pages two caches
TOKENS  ?= 24
ENGINE  ?= artifacts/$(notdir $(MODEL))-ort
PYTEST_ARGS ?=

.PHONY: help venv run test test-fast plan bench-gpu gpu-parity trt-engine clean

help:
	@echo "make run        build the ONNX Runtime engine of the tiny Gemma 4 (or MODEL=dir) and generate (PROMPT=text, TOKENS=n)"
	@echo "make test       run the CPU test suite (HF parity, kernels under TRITON_INTERPRET, runtime, export)"
	@echo "make test-fast  the same without the tests marked slow (over 10 s each)"
	@echo "make plan       KV bytes and capacity for the four published sizes"
	@echo "make trt-engine build + verify a TensorRT engine of MODEL (needs TensorRT >= 10.9 and a GPU)"
	@echo "make bench-gpu  kernels, runtime and inductor engine benches (CUDA, the gpu extra; OUT_DIR=dir)"
	@echo "make gpu-parity the four published sizes against Hugging Face in float64 (CUDA; PARITY_ARGS=...)"
	@echo "make clean      remove the virtualenv and artifacts"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[export,triton,test,serve]"
	touch $(STAMP)

venv: $(STAMP)

# The Triton of the GPU machines' image, beside the venv's (not on its path): the tests compile the kernels with it
# for sm_90 on the CPU (tests/test_device_triton.py), since the venv's newer Triton accepts code the image's rejects.
DEVICE_TRITON ?= triton==3.6.0
DEVICE_TRITON_DIR := $(VENV)/triton-device
$(DEVICE_TRITON_DIR)/.installed: $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(DEVICE_TRITON_DIR) "$(DEVICE_TRITON)"
	touch $@

# The main job: the ONNX Runtime engine of the model (built once into $(ENGINE)), then generation
# through the paged runtime. MODEL=dir uses a Hugging Face checkpoint directory instead of `tiny`.
run: $(STAMP)
	test -f $(ENGINE)/manifest.json || $(BIN)/g4rt build --model $(MODEL) --backend onnxruntime --out $(ENGINE)
	$(BIN)/g4rt generate --engine $(ENGINE) --prompt "$(PROMPT)" --max-new-tokens $(TOKENS)

test: $(STAMP) $(DEVICE_TRITON_DIR)/.installed
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP) $(DEVICE_TRITON_DIR)/.installed
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

plan: $(STAMP)
	$(BIN)/g4rt plan

# On a CUDA machine (the lent H200): kernels, runtime (262,144-position request), inductor engine vs HF.
# Needs the `gpu` extra; results land in $(OUT_DIR) (committed copies live in */results/).
OUT_DIR ?= artifacts/bench
bench-gpu:
	python3 -m g4rt.bench.kernels --out $(OUT_DIR)/kernels
	python3 -m g4rt.bench.engine --config 31b --out $(OUT_DIR)/engine --profile
	python3 -m g4rt.bench.engine --config 31b --out $(OUT_DIR)/matmuls --matmuls
	python3 -m g4rt.bench.runtime --config 31b --out $(OUT_DIR)/runtime

# On a CUDA machine: the four published sizes at full depth, eager and inductor engines, Triton and
# reference kernels, against Hugging Face in float64 (bench/parity.py; results in models/results/).
# PARITY_ARGS="--break-window" runs our engines with the sliding window W-1, which must fail.
gpu-parity:
	python3 -m g4rt.bench.parity --out $(OUT_DIR)/parity $(PARITY_ARGS)

# A TensorRT engine of MODEL, proven (DESIGN.md "First run on a TensorRT machine"): prerequisites
# (without TensorRT >= 10.9 and a GPU it stops there, naming what is missing), export with golden
# steps, plan build with progress, arena-copy inspection, polygraphy check, greedy tokens vs eager.
# TRT_ARGS passes build limits, e.g. TRT_ARGS="--chunk 8192 --max-batched-tokens 8192".
TRT_ENGINE ?= artifacts/$(notdir $(MODEL))-trt
trt-engine: $(STAMP)
	$(BIN)/g4rt trt-engine --model $(MODEL) --out $(TRT_ENGINE) $(TRT_ARGS)

clean:
	rm -rf $(VENV) artifacts
