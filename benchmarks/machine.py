"""The CPU a benchmark ran on, named the way every result file names it."""

from __future__ import annotations

from pathlib import Path


def cpu_name() -> str:
    """`model name` and `model` of /proc/cpuinfo: "Intel(R) Xeon(R) Processor model 207" ("?" if unreadable)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "?"
    return f"{fields.get('model name', '?')} model {fields.get('model', '?')}"
