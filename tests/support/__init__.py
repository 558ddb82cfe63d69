"""What the tests and the benchmarks share: servers, Ray nodes, clients, SSE, fakes.

No test module imports another test module or `tests.conftest`, and `benchmarks/` imports from
`tests/` only this package (checked by tests/test_architecture.py). Pytest fixtures stay in
`tests/conftest.py`, which imports what it needs from here.
"""
