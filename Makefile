# Two entry points for a fresh machine (Python 3.11, no GPU needed):
#   make train   set up .venv, then run the default training job (the planner's plan, 4 ranks)
#   make test    set up .venv, run the test suite on the locked set (torch 2.14.1, torchtitan 0.3.0),
#                then the smoke job on torch 2.11 with torchtitan 0.2.2 (make smoke, in .venv-smoke)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
SMOKE_VENV := .venv-smoke
SMOKE_STAMP := $(SMOKE_VENV)/.installed
SMOKE_TORCH := torch==2.11.0
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
PYTEST := -m pytest -q -p no:cacheprovider

.PHONY: train test suite smoke setup

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/locked.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -c constraints/locked.txt -e '.[test]'
	touch $(STAMP)

# The smoke job's environment is built as a cluster's would be: its torch first, then the
# project beside it (pip leaves that torch in place).
$(SMOKE_STAMP): pyproject.toml constraints/torch2.11.txt
	$(PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SMOKE_VENV)/bin/python -m pip install --quiet $(SMOKE_TORCH)
	$(SMOKE_VENV)/bin/python -m pip install --quiet -c constraints/torch2.11.txt -e '.[test]'
	touch $(SMOKE_STAMP)

train: $(STAMP)
	./run_train.sh

test: suite smoke

suite: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/python $(PYTEST) --durations=25 -n 2 --dist loadfile -m 'not smoke'

smoke: $(SMOKE_STAMP)
	$(SMOKE_VENV)/bin/python $(PYTEST) tests/test_compat.py tests/test_smoke.py

# tests/report/test_report.py renders plan.html in Debian's headless Chromium (~1.5 min to install).
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium
