"""One-off measurements behind the figures in docs/, run from the repository root: ``python -m benchmarks.NAME``.

Not installed with the package: they start fleets and ``redis-server`` through ``tests/support`` and
need the test extra (``pip install -e '.[test]'``). ``prefixcache bench`` is the benchmark users run.
"""
