# Two entry points for a fresh machine (Python 3.11, no GPU needed):
#   make train   set up .venv, then run the default training job (the planner's plan, 4 ranks)
#   make test    set up .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: train test setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(VENV)/bin/python -m torchtitan_autoparallel.planner.warm_up  # numba's compile, once
	touch $(STAMP)

train: $(STAMP)
	./run_train.sh --model.name llama3_auto_parallel

test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 -n 2 --dist loadfile

# tests/test_report.py renders plan.html in Debian's headless Chromium (~1.5 min to install).
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium
