"""Locust entry point: `locust -f loadtests/kvscope/locustfile.py --kvscope-spec SPEC ...` (run/locustspec.py)"""

from kvscope.run.loaduser import KVScopeUser  # noqa: F401  (Locust runs the User classes it finds here)
