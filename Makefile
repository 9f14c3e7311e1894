# Two commands for a newcomer: `make demo` and `make test`. Each installs what it needs first,
# into folders inside the checkout that git ignores (.venv, .runtimes, .airflow, .changeover).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIMES := 4.2.0 4.2.1 4.3.0
export AIRFLOW_HOME := $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False

SOAK_RUNS ?= 3

# $(call tier,NAME,PYTEST ARGS): one pytest run, its wall time printed at its end whether it passed or not.
define tier
start=$$(date +%s); $(BIN)/pytest -rs $(2); rc=$$?; \
  echo "make: tier '$(1)' took $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc
endef

.PHONY: demo test test-fast test-e2e soak docs lint java chromium sshd runtimes airflow-db clean

demo: java $(VENV)/.installed runtimes airflow-db
	$(BIN)/changeover demo

# CI runs this on a clean clone within 90 minutes; its budget is 35 (README). Two tiers, each timed: the Spark-free
# tests on two pytest workers, then the real clusters and Airflow one case at a time (they share two cores).
test: java chromium sshd $(VENV)/.installed runtimes airflow-db docs
	$(BIN)/ruff check dags plugins include tests bench
	@$(call tier,spark-free,-q -n 2 -m "not slow and not long" --durations=5)
	@$(call tier,real spark and airflow,-v -m "slow and not long" --durations=20)

# Not in CI: the long reproductions (marked long), each a case whose decision make test keeps in a faster form.
test-e2e: java chromium sshd $(VENV)/.installed runtimes airflow-db
	@$(call tier,long reproductions,-v -m long --durations=20)

# The unit tests and the control plane's decisions over the fake fleet, on the registries: no Spark, no Airflow.
test-fast: $(VENV)/.installed runtimes airflow-db
	$(BIN)/ruff check dags plugins include tests bench
	$(BIN)/pytest -q -rs -n 2 -m "not slow and not long" --durations=5

# Not in CI: make test-e2e, then the browser-triggered rolling upgrade through the real scheduler, SOAK_RUNS times.
soak: test-e2e
	@for i in $$(seq $(SOAK_RUNS)); do echo "soak run $$i of $(SOAK_RUNS)"; \
	  $(BIN)/pytest -q -rs -p no:cacheprovider tests/e2e -k "ui_triggered and sqlite" || exit 1; done

# The docs/ folder, as users read it: every page in the nav, every link resolved (mkdocs.yml sets strict).
docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict --quiet

lint: $(VENV)/.installed
	$(BIN)/ruff check dags plugins include tests bench

java:
	@command -v java >/dev/null 2>&1 || [ -x "$$JAVA_HOME/bin/java" ] || { \
	  echo "error: Java 17+ is missing: Spark 4 needs it. Install it (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) or set JAVA_HOME." >&2; exit 1; }
	@v=$$( ([ -x "$$JAVA_HOME/bin/java" ] && "$$JAVA_HOME/bin/java" -version || java -version) 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  [ "$${v:-0}" -ge 17 ] || { echo "error: Java $$v found, but Spark 4 needs Java 17 or newer. Install openjdk-17 and set JAVA_HOME." >&2; exit 1; }

# The browser test drives Airflow's UI with Debian's Chromium (Playwright's own browser downloads are not used).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "error: Chromium is missing: the browser test needs it. Install it (Debian/Ubuntu: sudo apt-get install chromium)." >&2; exit 1; fi; }

# The existing-cluster tests give each member a host of its own (a network namespace) reached over SSH, as a
# platform's would be: Debian's OpenSSH server, started by the tests inside those namespaces only.
sshd:
	@[ -x /usr/sbin/sshd ] || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get install -y -qq openssh-server >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq openssh-server >/dev/null; }; \
	  else echo "error: openssh-server is missing: the existing-cluster tests need it. Install it (Debian/Ubuntu: sudo apt-get install openssh-server)." >&2; exit 1; fi; }

$(VENV)/.installed: requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "error: Python 3.11 is needed as $(PYTHON)." >&2; exit 1; }
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv==0.13.8
	$(BIN)/uv pip install --quiet --python $(BIN)/python -r requirements.txt
	# pyspark last and forced: pyspark-client writes the same files under pyspark/.
	$(BIN)/uv pip install --quiet --python $(BIN)/python --reinstall --no-deps pyspark==4.2.0 py4j==0.10.9.9
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	touch $@

runtimes: $(VENV)/.installed
	@for v in $(RUNTIMES); do $(BIN)/changeover runtime install $$v >/dev/null || exit 1; done

airflow-db: $(VENV)/.installed
	@mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate >/dev/null
	$(BIN)/changeover db upgrade >/dev/null

clean:
	-$(BIN)/changeover cluster down
	rm -rf .changeover .airflow
