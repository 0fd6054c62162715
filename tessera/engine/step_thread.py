"""What the thread that loaded an engine does before handing it to a thread of its own that steps
it (AsyncLLMEngine's engine thread, a disaggregated worker's).

Two things, both about the machine the step runs on:
- the loading thread's OpenMP team would stay beside the stepping thread's and make every worker
  sleep between regions (tessera.engine.openmp_team);
- the new thread's malloc arena would hand each step's memory back to the kernel and fault it in
  again at the next (tessera.engine.malloc_tuning).
"""

from __future__ import annotations

from tessera.engine.malloc_tuning import keep_freed_memory
from tessera.engine.openmp_team import release_calling_thread_team


def hand_over_to_step_thread() -> None:
    """Call on the loading thread, before the stepping thread starts."""
    release_calling_thread_team()
    keep_freed_memory()
