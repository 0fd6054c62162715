"""Where the Triton tests run: on the GPU when there is one, else in Triton's CPU interpreter.

`gpu_or_interpreter()` must run before triton is first imported in the process: kernels are built
for the interpreter or the GPU when they are decorated, at import. Without a GPU it sets
TRITON_INTERPRET=1 and skips the calling module where triton is older than 3.7 (3.6's interpreter
cannot take a loaded scalar as a loop bound under numpy 2).
"""

from __future__ import annotations

import os

import pytest
import torch


def gpu_or_interpreter() -> bool:
    """True when the kernels will run on a GPU; else the interpreter is set up (or the module skipped)."""
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if on_gpu:
        pytest.importorskip("triton")
    else:
        os.environ["TRITON_INTERPRET"] = "1"
        pytest.importorskip("triton", minversion="3.7")
    return on_gpu
