"""Testing helpers for lightkv and for packages that extend it.

* `check_policy`: the policy contract as a reusable test (`lightkv.testing.contract`).
* Tiny random models of every supported family and prompt batches for them
  (`lightkv.testing.models`): ``TINY_MODELS[name].build()``, ``.row(model)``, ``.collate(rows)``.
"""

from .contract import check_policy, contract_batch
from .models import (
    IMAGE,
    NEWLINE,
    PAD,
    TINY_MODELS,
    VIDEO,
    VOCAB,
    Row,
    TinyModel,
    build_llava,
    build_llava_next,
    left_pad,
    llava_next_tokens,
    text_ids,
)

__all__ = [
    "TINY_MODELS",
    "IMAGE",
    "NEWLINE",
    "PAD",
    "VIDEO",
    "VOCAB",
    "TinyModel",
    "Row",
    "build_llava",
    "build_llava_next",
    "check_policy",
    "contract_batch",
    "left_pad",
    "llava_next_tokens",
    "text_ids",
]
