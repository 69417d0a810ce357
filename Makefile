# kvspec: `make verify` (the main job) and `make test`. Both create .venv and
# install the project (with everything in pyproject.toml) when it is missing
# or older than pyproject.toml, so on a fresh machine they are the only set-up.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: verify test fuzz prove bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

verify: $(STAMP)
	$(BIN)/kvspec verify

test: $(STAMP)
	$(BIN)/python -m pytest

fuzz: $(STAMP)
	$(BIN)/kvspec fuzz --budget $${BUDGET:-120}

prove: $(STAMP)
	$(BIN)/kvspec prove

lint: $(STAMP)
	$(BIN)/ruff check spec impl fuzz proofs tests

clean:
	rm -rf $(VENV) fuzz-failures *.egg-info
