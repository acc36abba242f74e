"""What `scripts/gpu-check.sh` needs on a GPU machine with no network, gathered here.

    python -m bench gpu bundle [--wheels .whl] [--python-version 3.12]

The GPU image holds PyTorch, transformers and much else, but not every package raging runs on.
This collects wheels of the rest (the versions this environment runs, for the GPU machine's
Python) and the default model's tokenizer and config (in WHEELS/tokenizer), which `gpu-check.sh`
installs and reads there. What the image lacks is worked out from raging's requirements and
those of the packages its CUDA tests import, followed through this environment's installed
metadata, down to the packages the image already holds.
"""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# The image's Python packages as a session read them on 2026-11-17 (the device tool's
# KINDS.md); a package named here is not carried, nor are its own requirements.
_IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE = frozenset(canonicalize_name(name) for name in _IMAGE_PACKAGES.split())
# Carried although the image has them: pydantic and others need newer releases than an
# image may hold, and these small pure-Python ones then stand in front of its own.
NEWER = frozenset({"typing-extensions"})
# Beyond raging's own requirements: what the CUDA tests import (tests/e2e/cluster.py's client).
TEST_ROOTS = ("pytest", "pytest-timeout", "httpx", "openai")
# Where the GPU image's python (3.12) finds binary wheels: pip matches each tag exactly.
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
LIMIT_MB = 60  # what travels with the working tree is 64 MiB in all


def carried(python_version: str) -> dict[str, str]:
    """{package: the version installed here} of every package raging and the CUDA tests
    need, on a Python of `python_version`, that the image lacks."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    waiting = [Requirement(text) for text in (*project["dependencies"], *TEST_ROOTS)]
    environment = {"python_version": python_version, "python_full_version": python_version}
    found: dict[str, str] = {}
    followed: set[tuple[str, str]] = set()  # (package, extra) whose requirements were read
    while waiting:
        requirement = waiting.pop()
        name = canonicalize_name(requirement.name)
        if name in IMAGE and name not in NEWER:
            continue
        found[name] = metadata.version(name)
        for extra in ("", *requirement.extras):  # uvicorn[standard]: its extra's too
            if (name, extra) not in followed:
                followed.add((name, extra))
                waiting += _needs(name, {**environment, "extra": extra})
    return dict(sorted(found.items()))


def _needs(package: str, environment: dict[str, str]) -> list[Requirement]:
    """The requirements of the installed `package` that hold in `environment`."""
    needs = [Requirement(text) for text in metadata.requires(package) or ()]
    return [need for need in needs if need.marker is None or need.marker.evaluate(environment)]


def download(packages: dict[str, str], out: Path, python_version: str) -> None:
    """Binary wheels of `packages` for the GPU machine, into `out` (emptied of wheels first:
    two versions of one package stop its install there)."""
    for old in out.glob("*.whl"):
        old.unlink()
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "--python-version", python_version,
         "--implementation", "cp", *platforms, "-d", str(out),
         *(f"{name}=={version}" for name, version in packages.items())],
        check=True)


def copy_tokenizer(model_folder: Path, out: Path) -> Path:
    """The default model's config and tokenizer files, which `bench gpu prepare` reads."""
    target = out / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (model_folder / name).exists():
            shutil.copy(model_folder / name, target / name)
    return target


def bundle(model_folder: Path, out: Path, python_version: str) -> str:
    """Gather the bundle into `out`; what it holds, a line per package."""
    out.mkdir(parents=True, exist_ok=True)
    packages = carried(python_version)
    download(packages, out, python_version)
    copy_tokenizer(model_folder, out)
    size_mb = _megabytes(out.rglob("*"))
    if size_mb > LIMIT_MB:
        raise RuntimeError(f"{out} holds {size_mb:.1f} MB: more than travels ({LIMIT_MB} MB)")
    listed = "\n".join(f"  {name}=={version}" for name, version in packages.items())
    return (f"{len(packages)} packages the GPU image lacks, for Python {python_version}, in "
            f"{out} ({size_mb:.1f} MB with the tokenizer):\n{listed}")


def _megabytes(paths: Iterable[Path]) -> float:
    return sum(path.stat().st_size for path in paths if path.is_file()) / 2**20
