# Two entry points for a fresh machine (Python 3.11, no GPU needed):
#   make train   set up .venv, then run the default training job
#   make test    set up .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	./run_train.sh

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider
