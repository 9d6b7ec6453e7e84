PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: setup test demo lint

# torch first, pinned, when absent: an unpinned install pulls a multi-GB CUDA build
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	@$(PIP) install -q -e ".[dev]"

test: setup
	$(PYTHON) -m pytest -q tests

demo: setup
	$(PYTHON) -m gradpress.demo

lint: setup
	$(PYTHON) -m ruff check gradpress tests
