"""DigitGrid-VQA: a synthetic VQA task whose answers depend on one image region.

See `lightkv_lab.tasks.digitgrid.data` for the images, questions, vocabulary and batching.
Needs scikit-learn (the ``demo`` extra) for the handwritten digits. The names of
`lightkv_lab.tasks.digitgrid.data` are available here too; they load on first use, because the
shared batching (`lightkv_lab.tasks.batching`) imports this package's vocabulary, and the data
module imports the batching.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("data", "vocab", "config", "images"):
        raise AttributeError(name)  # submodules and dunders: the import system's own lookups
    import importlib

    data = importlib.import_module(f"{__name__}.data")
    try:
        return getattr(data, name)
    except AttributeError:
        raise AttributeError(
            f"module 'lightkv_lab.tasks.digitgrid' has no attribute {name!r}"
        ) from None
