"""Serving benchmark against a running `tessera serve` (see tessera/bench/serve.py for the flags).

    tessera serve &   # in another shell
    python benchmarks/serve.py --num-prompts 64 --request-rate 8 --input-len 128 --output-len 64 \
        --slo-ttft-ms 500 --slo-tpot-ms 100
"""

import sys

from tessera.bench.serve import main

if __name__ == "__main__":
    main(sys.argv[1:])
