# `make deploy|bench|teardown|rollout INVENTORY=ansible/inventories/netns`: namespace hosts (made here), per-host
# configs from host_vars; the bench finds each host's deployment and its Locust workers by the inventory's
# variables, and each host's manifests and logs are collected into the run folder.
PRE_DEPLOY  := bash ansible/scripts/netns-hosts.sh up
DEPLOY_ARGS  =
BENCH_ARGS   =  # every config deployed (each host's come from its host_vars), not CONFIGS
POST_BENCH   = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
PRE_ROLLOUT := bash ansible/scripts/netns-hosts.sh up
