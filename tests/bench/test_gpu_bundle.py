"""What `bench gpu bundle` carries to a GPU machine, read off this environment's metadata."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

from bench import gpu_bundle


def test_the_bundle_carries_what_raging_needs_and_the_image_lacks() -> None:
    carried = gpu_bundle.carried("3.12")
    # raging's own requirements, their requirements, and uvicorn[standard]'s extra.
    for package in ("pyzmq", "starlette", "uvicorn", "httptools", "pydantic", "pydantic-core",
                    "xgrammar", "openai"):
        assert carried.get(package) == metadata.version(package), package
    for package in ("torch", "numpy", "transformers", "msgpack", "pytest", "httpx"):
        assert package not in carried, f"{package} is in the image"
    assert "typing-extensions" in carried  # newer than an image may hold


def test_requirements_are_read_for_the_target_python_and_extra() -> None:
    def needs(package: str, python: str, extra: str = "") -> set[str]:
        environment = {"python_version": python, "python_full_version": python, "extra": extra}
        return {need.name for need in gpu_bundle._needs(package, environment)}

    assert "exceptiongroup" in needs("anyio", "3.10")  # python_version < "3.11"
    assert "exceptiongroup" not in needs("anyio", "3.12")
    assert "httptools" in needs("uvicorn", "3.12", "standard")
    assert "httptools" not in needs("uvicorn", "3.12")


def test_the_tokenizer_files_are_copied_with_the_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (model / name).write_text(name)
    target = gpu_bundle.copy_tokenizer(model, tmp_path / "wheels")
    assert sorted(path.name for path in target.iterdir()) == ["config.json", "tokenizer.json"]
