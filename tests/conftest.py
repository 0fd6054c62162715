"""Shared fixtures: tiny random models written on the fly, and the real default model.

Tests that use `default_model_path` are marked `integration` automatically: they need the default
model in TESSERA_CACHE (downloaded once with pip on first use) and take tens of seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., Path]:
    """`factory(**overrides) -> Path`: a tiny HF model folder (see make_tiny_model_dir), written
    once per distinct set of overrides in the session."""
    made: dict[tuple, Path] = {}

    def factory(**overrides) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        if key not in made:
            made[key] = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), **overrides)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> Path:
    """The default tiny model: Llama, 2 layers, 4 query heads sharing 2 KV heads (GQA), untied."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1), fetched once into the cache."""
    from tessera.config import DEFAULT_MODEL
    from tessera.model.download import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' own load of the default GGUF file, in float32: the reference model. Loading
    it takes tens of seconds, so every integration test shares this one."""
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "default_model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
