# kvspec: `make verify` (the main job) and `make test`. Both create .venv and
# install the project (with everything in pyproject.toml) when it is missing
# or older than pyproject.toml, so on a fresh machine they are the only set-up.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: verify test fuzz prove bench mutants e2e conformance vllm mutation mutation-changed lint clean docs docs-serve docs-tables

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,test,proofs,e2e,bench,docs,campaign]'
	touch $(STAMP)

verify: $(STAMP)
	$(BIN)/kvspec verify

# On every core (pytest-xdist). --dist loadfile: each test file runs whole
# on one worker (its module fixtures built once), except the files
# tests/conftest.py's SPREAD names, whose tests go one by one to whichever
# worker is free. The slowest tests are listed at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile --durations=15

fuzz: $(STAMP)
	$(BIN)/kvspec fuzz --budget $${BUDGET:-120}

prove: $(STAMP)
	$(BIN)/kvspec prove

bench: $(STAMP)
	$(BIN)/kvspec bench
	$(BIN)/kvspec bench --harness

mutants: $(STAMP)
	$(BIN)/kvspec mutants

e2e: $(STAMP)
	$(BIN)/kvspec e2e

conformance: $(STAMP)
	$(BIN)/kvspec conformance

# vLLM's KV-cache manager for --target vllm (CPU only, about 2 minutes and
# 2.8 GB): PyTorch's CPU build, vLLM with --no-deps and the packages its
# manager imports, pinned (an extra cannot say --no-deps; tools/install-vllm
# says why). Not part of make test: without it the recorded vLLM traces
# replay against our pool only, and the tests say so.
vllm: $(STAMP)
	tools/install-vllm $(VENV)

# Mutation score of spec/ and impl/ (slow; not part of make test): mutmut makes
# the mutants, fuzz/commands/mutation_run.py runs them (workers that collect
# the tests once; per mutant only the tests that execute its statement;
# triaged equivalents of a file unchanged since docs/mutation-stamps.json
# are not run again: `make mutation MUTATION_ARGS=--recheck` runs them too).
# Config: [tool.mutmut] in pyproject.toml. Report: docs/mutation.md.
mutation: $(STAMP)
	rm -rf mutants
	HYPOTHESIS_PROFILE=mutation $(BIN)/python -m kvspec.fuzz.commands.mutation_run --max-children $$(nproc 2>/dev/null || echo 2) $(MUTATION_ARGS)
	$(BIN)/python -m kvspec.fuzz.commands.mutation_report  # exit 1 if a survivor is not triaged

# Mutation of the lines changed since git revision BASE (a PR's lines):
# survivors with file:line and the mutation (docs/mutation.md).
BASE ?= main
mutation-changed: $(STAMP)
	HYPOTHESIS_PROFILE=mutation $(BIN)/kvspec mutants --changed $(BASE) --max-children $$(nproc 2>/dev/null || echo 2)

# The docs site (mkdocs.yml): strict, so a broken link, anchor, picture or
# API reference fails; the tables and pictures written into the pages
# (make docs-tables) are filled again from the registry and the spec
# (fuzz/docgen.py). Output: site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The tables and pictures written into docs/*.md and docs/pictures/ (fuzz/docgen.py),
# rewritten from the registry, the schema and the records; tests/test_docs.py fails
# while one is stale.
docs-tables: $(STAMP)
	$(BIN)/python -m kvspec.fuzz.docgen write

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict -a 127.0.0.1:8000

lint: $(STAMP)
	$(BIN)/ruff check spec impl fuzz proofs tests

clean:
	rm -rf $(VENV) fuzz-failures *.egg-info site docs-artifacts
