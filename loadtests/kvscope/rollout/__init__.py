"""Rollouts gated on the verdict: roll a storage config, connector version or image to a cluster one batch at a
time, gate every batch on a short bench against a golden server, stop and roll back on a wrong answer.

`record` holds the typed rollout record (results/<rollout-id>/rollout.json) and its words; `ansible` the
playbook runs and what each host serves; `gate` the gate's workload and its bench; `engine` the batches,
their steps, decisions, Ctrl-C and resume; `report` rollout.md; `cli` the `kvscope rollout` command.
"""
