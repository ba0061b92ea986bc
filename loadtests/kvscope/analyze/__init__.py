"""Stage 4, analysis: fidelity scores, verdicts and the gate, hit rates, reports. Needs no server."""
