"""DigitGrid-VQA: a synthetic VQA task whose answers depend on one image region.

See `lightkv.digitgrid.data` for the images, questions, vocabulary and batching.
Needs scikit-learn (the ``demo`` extra) for the handwritten digits.
"""

from lightkv.digitgrid import data
from lightkv.digitgrid.data import *

__all__ = list(data.__all__)
