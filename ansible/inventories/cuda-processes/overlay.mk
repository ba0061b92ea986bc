# `make deploy|bench|teardown|status INVENTORY=ansible/inventories/cuda-processes` on a CUDA host without containers
# or a registry, after docker/offline-wheels/bootstrap.sh: the host's Python (KVSCOPE_PYTHON, default python3) holds
# torch, vLLM, the connectors, the harness and Ansible, and the checkout's harness and connector are put on
# its path; no environment is made and nothing is installed first.
PY        := $(or $(KVSCOPE_PYTHON),python3)
KVSCOPE   := $(PY) -m kvscope.cli
PLAYBOOK  := $(PY) -m ansible playbook -i $(call q,$(INVENTORY))
HARNESS   :=
SETUP     :=
export KVSCOPE_PYTHON := $(PY)
export PYTHONPATH := $(CURDIR)/loadtests:$(CURDIR)/connector$(if $(PYTHONPATH),:$(PYTHONPATH))
export PYTHONUNBUFFERED := 1
