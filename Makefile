# Every target creates .venv and installs what it needs when missing.
# TORCH picks the torch requirement; CI sets TORCH='torch==2.13.0' to take the
# CPU wheel that lies on this kind of machine instead of downloading a CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test typecheck bench clean

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
test: $(STAMP)
	scripts/ensure-redis-server
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected" >&2; exit 1; fi; exit $$rc

# The package is strict-typed (pyproject's [tool.mypy]); engines' own mypy reads it.
typecheck: $(STAMP)
	$(PY) -m mypy kvtier

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
