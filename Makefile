# Set-up is part of every target: each creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs
DEMO_MODEL := $(RUN_DIR)/demo-tiny

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# Without an NVIDIA GPU take the CPU build of torch first, so that "torch>=2.6" is already
	@# satisfied and pip does not pull a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch==2.13.0 || true; fi
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/warpspec create-checkpoint $(DEMO_MODEL)
	$(VENV)/bin/warpspec generate --model $(DEMO_MODEL) --prompt "def main():" --max-tokens 32 --json

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(RUN_DIR) .pytest_cache .ruff_cache
