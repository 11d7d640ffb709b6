"""Testing helpers for lightkv and for packages that extend it.

* `check_policy`: the policy contract as a reusable test (`lightkv.testing.contract`).
* `TINY_LLAVA`: a tiny random LLaVA-1.5 built from configs (no download) and prompt batches
  for it: ``TINY_LLAVA.build()``, ``.row(model)``, ``.collate(rows)``; what the docs' examples
  and a package's own tests run sessions on.
* `lightkv.testing.common`: the token ids, `Row` and padding helpers every tiny model uses.

Tiny models of every other family are the laboratory's (``lightkv_lab.tiny.TINY_MODELS``):
the library does not need them at run time, so its wheel does not ship them.
"""

from .common import IMAGE, NEWLINE, PAD, VIDEO, VOCAB, Row, TinyModel, left_pad, text_ids
from .contract import check_policy, contract_batch
from .llava import TINY_LLAVA, build_llava

__all__ = [
    "IMAGE",
    "NEWLINE",
    "PAD",
    "TINY_LLAVA",
    "VIDEO",
    "VOCAB",
    "Row",
    "TinyModel",
    "build_llava",
    "check_policy",
    "contract_batch",
    "left_pad",
    "text_ids",
]
