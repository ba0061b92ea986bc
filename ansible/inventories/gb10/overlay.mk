# `make deploy|bench|teardown INVENTORY=ansible/inventories/gb10`, run on the load-generator host (the
# repository, venvs and model at the same paths as on the nodes). Each node's deployment.json is fetched
# into the run folder first; the bench finds them there and its workers by the inventory's variables.
DEPLOY_ARGS  =
BENCH_ARGS   =  # every config deployed (each host's come from its host_vars), not CONFIGS
PRE_BENCH    = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
POST_BENCH   = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
