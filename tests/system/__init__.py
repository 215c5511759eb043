"""System tests: the real ``dtrain train`` (torch's elastic agent, real worker processes), with
faults injected from outside, many times over. Run from the repository root:
``python -m tests.system.chaos`` (``make chaos``). Not collected by pytest (no ``test_*.py``
here); ``tests/test_chaos.py`` runs the quick form under ``make test-slow``."""
