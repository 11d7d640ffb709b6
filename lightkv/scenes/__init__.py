"""Scenes-VQA: a synthetic VQA task with the token statistics of natural images.

See `lightkv.scenes.data` for the images, questions, vocabulary and batching. The model,
trainer and evaluation are DigitGrid's (`lightkv.digitgrid`), parametrised by task.
"""

from lightkv.scenes import data
from lightkv.scenes.data import *

__all__ = list(data.__all__)
