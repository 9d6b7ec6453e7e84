PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: setup test demo lint mutants timing long compat

# torch first, pinned, when absent: an unpinned install pulls a multi-GB CUDA build; then the package
# and its extras with the installed torch held at its version (an extra must never replace it)
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	@$(PIP) install -q -e ".[dev]" "torch==$$($(PYTHON) -c 'import torch; print(torch.__version__.split("+")[0])')"

test: setup
	$(PYTHON) -m pytest -q -m "not timing and not long" tests

demo: setup
	$(PYTHON) -m gradpress.demo

lint: setup
	$(PYTHON) -m ruff check gradpress tests

# sampled mutation testing of the core modules (cosmic-ray, on a copy of the tree; ~30 min on 2 cores;
# report in bench-results/mutants-report.md, see docs/testing.md); not part of `make test`
MUTANTS_ARGS ?=
mutants: setup
	@$(PIP) install -q -e ".[mutants]"
	$(PYTHON) tests/mutants.py --report bench-results/mutants-report.md $(MUTANTS_ARGS)

# tests that assert wall-clock speed (emulated link goodput): benchmarks, not unit tests
timing: setup
	$(PYTHON) -m pytest -q -m timing tests

# end-to-end runs of 30 s or more (a stopped worker's run): kept out of
# `make test` so the suite stays under 15 minutes on 2 cores; shorter tests cover the same code
long: setup
	$(PYTHON) -m pytest -q -m long tests

# the suite on another torch release, in a venv of its own (.venv-torch<V>): `make compat COMPAT_TORCH=2.2.2`.
# PyPI's x86-64 wheels of such releases are CUDA builds (~5 GB with their libraries; they run on the CPU), and
# exist only for the Pythons of their day (2.2.2: 3.8-3.12): PYTHON=python3.11 make compat picks another.
# numpy < 2: what the older wheels were built against (torch 2.2.2 with numpy 2: "Numpy is not available").
# transformers is removed where it disables itself (release 5, below torch 2.6): torch 2.2's torch.onnx imports
# it, printing two lines in every run (the Accelerate/Transformers tests then skip).
# About 10 min on 2 cores (plus the download); see docs/testing.md, "Older torch releases". Not part of
# `make test`. COMPAT_PYTEST_ARGS picks tests: `make compat COMPAT_PYTEST_ARGS=tests/test_torch_compat.py`.
COMPAT_TORCH ?= 2.2.2
COMPAT_VENV := .venv-torch$(COMPAT_TORCH)
COMPAT_PYTEST_ARGS ?= -m "not timing and not long" tests
compat:
	@test -x $(COMPAT_VENV)/bin/pip || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q "torch==$(COMPAT_TORCH)" "numpy<2"
	$(COMPAT_VENV)/bin/pip install -q -e ".[dev]" "torch==$(COMPAT_TORCH)" "numpy<2"
	@$(COMPAT_VENV)/bin/python -c "from transformers.utils import is_torch_available as ok; raise SystemExit(not ok())" \
		2>/dev/null || $(COMPAT_VENV)/bin/pip uninstall -q -y transformers
	$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_PYTEST_ARGS)
