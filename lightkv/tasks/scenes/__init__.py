"""Scenes-VQA: a synthetic VQA task with the token statistics of natural images.

See `lightkv.tasks.scenes.data` for the images, questions, vocabulary and batching. The model,
trainer and evaluation are DigitGrid's (`lightkv.tasks.digitgrid`), parametrised by task.
"""

from lightkv.tasks.scenes import data
from lightkv.tasks.scenes.data import *

__all__ = list(data.__all__)
