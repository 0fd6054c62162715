"""Tessera: an LLM inference and serving engine."""

from tessera.sampling import RequestOutputKind, SamplingParams

__all__ = ["LLM", "RequestOutputKind", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from tessera.engine.llm import LLM

        return LLM
    raise AttributeError(name)
