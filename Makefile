# Two commands on a fresh machine: `make demo` and `make test`.
# Both create / refresh the project virtualenv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.draftsmith-installed

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-data.txt requirements-interop.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	$(PY) -m pip install -q --no-deps -r requirements-interop.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m draftsmith.demo

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 tests

bench: $(STAMP)
	$(PY) benchmarks/bench_foundation.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
