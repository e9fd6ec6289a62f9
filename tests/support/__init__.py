"""What the tests (and the measurements in ``benchmarks/``) start as processes: replica fleets behind
``sglang-router``, and ``redis-server``. Not part of the installed package."""
