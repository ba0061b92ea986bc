# `make deploy|bench|teardown|rollout INVENTORY=ansible/inventories/netns`: namespace hosts (made here), per-host
# configs from host_vars, Locust workers on kvh1 and kvh2 with this machine (10.77.0.1) as the master, and each
# host's manifests and logs collected into the run folder.
PRE_DEPLOY  := bash ansible/scripts/netns-hosts.sh up
DEPLOY_ARGS  =
DEPLOYMENTS := runs/netns/kvh1/deployment.json,runs/netns/kvh2/deployment.json,runs/netns/kvh3/deployment.json
BENCH_ARGS   = --worker-hosts kvh1,kvh2 --ssh-config /var/lib/kvscope/netns/config --master-host 10.77.0.1
POST_BENCH   = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
PRE_ROLLOUT := bash ansible/scripts/netns-hosts.sh up
