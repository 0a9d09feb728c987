# g4rt: everything a newcomer or CI needs goes through these targets.
# `make run` and `make test` each create or refresh the virtualenv they need.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The CPU build of torch 2.13.0 lies on this project's machines; GPU-only packages are in the `gpu` extra.
TORCH   ?= torch==2.13.0
MODEL   ?= tiny
PROMPT  ?= 2,15,7,42
TOKENS  ?= 24
PYTEST_ARGS ?=

.PHONY: help venv run test test-fast plan build-tiny bench-gpu clean

help:
	@echo "make run        generate tokens with the embedded tiny Gemma 4 (MODEL=dir|tiny, PROMPT=ids, TOKENS=n)"
	@echo "make test       run the CPU test suite (HF parity, kernels under TRITON_INTERPRET, runtime, export)"
	@echo "make plan       KV bytes and capacity for the four published sizes"
	@echo "make build-tiny export + build the ONNX Runtime engine of the tiny model into artifacts/"
	@echo "make clean      remove the virtualenv and artifacts"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[export,triton,test]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/g4rt generate --model $(MODEL) --token-ids $(PROMPT) --max-new-tokens $(TOKENS)

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

plan: $(STAMP)
	$(BIN)/g4rt plan

clean:
	rm -rf $(VENV) artifacts
