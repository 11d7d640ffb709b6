"""Scenes-VQA: a synthetic VQA task with the token statistics of natural images.

See `lightkv_lab.tasks.scenes.data` for the images, questions, vocabulary and batching. The model,
trainer and evaluation are DigitGrid's (`lightkv_lab.tasks.digitgrid`), parametrised by task.
"""

from lightkv_lab.tasks.scenes import data
from lightkv_lab.tasks.scenes.data import *  # noqa: F403 (re-exports data.__all__)

__all__ = list(data.__all__)
