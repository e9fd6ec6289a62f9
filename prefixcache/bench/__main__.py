"""``python -m prefixcache.bench [flags]``: the benchmark without the ``prefixcache`` command."""
from __future__ import annotations

import argparse

from prefixcache.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache.bench",
                                     description="Benchmark prefixcache against plain generate(), manual cache "
                                                 "reuse and transformers' generate_batch on shared-prefix workloads.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
