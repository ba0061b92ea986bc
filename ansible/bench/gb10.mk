# `make deploy|bench|teardown INVENTORY=ansible/inventories/gb10`, run on the load-generator host (the
# repository, venvs and model at the same paths as on the nodes). Each node's deployment.json is fetched
# into the run folder first; the bench reads those.
DEPLOY_ARGS  =
PRE_BENCH    = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
DEPLOYMENTS  = $(subst $(eval) ,$(comma),$(foreach h,spark-1 spark-2 spark-3,results/$(RUN_ID)/hosts/$(h)/deployment.json))
BENCH_ARGS   = --worker-hosts loadgen,spark-3 --ssh-config $(HOME)/.ssh/config --master-host 192.168.50.20
POST_BENCH   = $(PLAYBOOK) ansible/collect.yml -e $(call q,collect_to=$(CURDIR)/results/$(RUN_ID))
