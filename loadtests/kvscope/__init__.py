"""kvscope: deploy vLLM storage configs, replay RAG workloads, score TTFT, hit rate and fidelity.

The package is grouped by stage, and imports only go down the list: `artifacts` (what travels between
stages), `config` (matrix, rendering), `deploy` (model, images, the Ansible roles' helpers), `run`
(workloads, Locust, records, treatments), `analyze` (fidelity, verdicts, reports).
"""

from pathlib import Path

__version__ = "0.2.0"

HARNESS = Path(__file__).resolve().parent  # the package data: matrix.yaml, scenarios.yaml, locustfile.py
REPO = HARNESS.parent.parent  # a checkout's root (ansible/, docker/): the rollout and image helpers need one
