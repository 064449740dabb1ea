# The two commands of the README. Both create or reuse .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning_gh-installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test lint clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m lightning_gh demo $(DEMO_ARGS)

# pytest exits 5 when it collects no test: say so and fail, since this suite is never empty. `-n auto`: one pytest-xdist
# worker per CPU (two on CI); every test runs in a worker of its own process state, as it does alone. `--dist
# worksteal`: an idle worker takes queued tests from a busy one, so a few long tests do not leave a core idle.
test: $(STAMP)
	@$(PY) -m pytest -n auto --dist worksteal $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; fi; exit $$rc

# pyflakes, bugbear and import order over the whole repository ([tool.ruff] in pyproject.toml); .ci/run runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs bench_out .pytest_cache
