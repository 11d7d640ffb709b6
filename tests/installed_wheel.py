"""The library's wheel alone, in a fresh virtual environment with the CPU torch (`make
test-wheel`, run by ``.ci/run``; issue 52 item 4). Not a pytest module: it runs in two
interpreters.

``python tests/installed_wheel.py pins WHEEL`` (in ``.venv``) prints pip requirements for the
wheel's own dependencies at the versions ``.venv`` holds, torch as its CPU build, so the
fresh environment gets what the tests ran with, and no CUDA wheels.

``python tests/installed_wheel.py check`` (in the fresh environment, outside the checkout)
checks that ``lightkv`` comes from the installed wheel and the laboratory is absent, that
torch is a CPU build and no NVIDIA wheel came along, runs ``lightkv.apply`` on a tiny random
LLaVA built with transformers alone (a prefill and two greedy tokens, the vision KV
compressed to the preset's target), and runs the ``lightkv`` command: ``presets`` lists
every preset, and a laboratory command says how to install the laboratory from the
repository.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import zipfile
from importlib.metadata import distributions, version


def pins(wheel: str) -> list[str]:
    """``name==version`` for each runtime dependency of ``wheel`` (extras left out), at the
    version installed here; torch as the CPU build of its release."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", line.split(":", 1)[1].strip()).group(0)
        installed = version(name)
        if name == "torch":
            base = installed.split("+")[0]
            linux = sys.platform == "linux" and platform.machine() == "x86_64"
            installed = f"{base}+cpu" if linux else base  # the CPU index's local version
        out.append(f"{name}=={installed}")
    return out


def check() -> None:
    import torch

    import lightkv

    assert sys.prefix != sys.base_prefix, "not in a virtual environment"
    assert lightkv.__file__.startswith(sys.prefix), f"lightkv from {lightkv.__file__}"
    assert torch.version.cuda is None, f"a CUDA build of torch: {torch.__version__}"
    names = sorted({d.metadata["Name"] for d in distributions()})
    assert not [n for n in names if n.lower().startswith("nvidia")], names
    assert "lightkv-lab" not in names and "lightkv_lab" not in sys.modules, names
    try:
        import lightkv_lab  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the laboratory is importable beside the wheel")

    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    image_token, grid = 5, 8  # 8 x 8 = 64 vision tokens per image
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=4 * grid,
            patch_size=4,
        ),
        text_config=LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
        ),
        image_token_id=image_token,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config).eval()
    ids = torch.tensor([[1, 7, 8] + [image_token] * grid * grid + [9, 10, 11]])
    pixels = torch.randn(1, 3, 4 * grid, 4 * grid)
    with lightkv.apply(lightkv.load("lightkv-budget"), model) as session, torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=2, do_sample=False)
    report = session.report()
    assert out.shape == (1, ids.shape[1] + 2), out.shape
    assert report.kept_vision_fraction is not None and report.kept_vision_fraction < 0.9, report
    print(
        f"lightkv {version('lightkv')} from the wheel, torch {torch.__version__}: "
        f"lightkv.apply kept {report.kept_vision_fraction:.3f} of the vision KV "
        f"(target {report.target_kept_fraction:.3f}); {len(names)} distributions installed"
    )

    from lightkv.presets import PRESETS

    cli = [sys.executable, "-m", "lightkv"]
    listed = subprocess.run([*cli, "presets"], capture_output=True, text=True, check=True)
    assert len(listed.stdout.splitlines()) == len(PRESETS), listed.stdout
    demo = subprocess.run([*cli, "demo"], capture_output=True, text=True)
    assert demo.returncode == 2 and "pip install ./lab" in demo.stderr, demo.stderr
    print(f"lightkv presets: {len(listed.stdout.splitlines())} presets; {demo.stderr.strip()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pins"]:
        print("\n".join(pins(sys.argv[2])))
    elif sys.argv[1:] == ["check"]:
        check()
    else:
        raise SystemExit("usage: installed_wheel.py pins WHEEL | check")
