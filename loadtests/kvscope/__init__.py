"""kvscope: deploy vLLM storage configs, replay RAG workloads, score TTFT, hit rate and fidelity."""
