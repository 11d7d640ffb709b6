"""SymbolGrid-VQA: a synthetic VQA task whose answers need the content of single vision tokens.

See `lightkv_lab.tasks.symbolgrid.data` for the images, questions, vocabulary and batching. The
model, trainer and evaluation are DigitGrid's (`lightkv_lab.tasks.digitgrid`), parametrised by task.
"""

from lightkv_lab.tasks.symbolgrid import data
from lightkv_lab.tasks.symbolgrid.data import *  # noqa: F403 (re-exports data.__all__)

__all__ = list(data.__all__)
