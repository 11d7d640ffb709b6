"""Tiny random models of every supported family, and prompt batches for them.

Built from config objects (no download), in well under a second each; used by the test
suite and the benchmarks (the library ships only the tiny LLaVA, `lightkv.testing.TINY_LLAVA`,
which is ``TINY_MODELS["llava"]`` here). Every family has:

* ``build(attn_implementation="sdpa", dtype=torch.float32, seed=0, **sizes)`` -> model,
* ``row(model, ..., seed=0)`` -> one prompt (`Row`: 1-D ``input_ids`` + the row's image inputs),
* ``collate(rows)`` -> the keyword arguments of a left-padded batch.

```python
from lightkv_lab.tiny import TINY_MODELS
fam = TINY_MODELS["llava"]
model = fam.build()
batch = fam.collate([fam.row(model, images=1, seed=0), fam.row(model, images=2, seed=1)])
model.generate(**batch, max_new_tokens=5)
```
"""

from __future__ import annotations

__all__ = ["TINY_MODELS"]

from lightkv.testing.common import NEWLINE, TinyModel
from lightkv.testing.llava import TINY_LLAVA

from . import (  # families with a module each (functions named build, row, ...)
    gemma3,
    idefics3,
    llava_next_video,
    llava_onevision,
    pixtral,
    qwen2_vl,
    qwen3_vl,
)
from .fuyu import build_fuyu, collate_fuyu, examples_fuyu, row_fuyu
from .internvl import build_internvl, examples_internvl, row_internvl
from .llava_next import (
    build_llava_next,
    collate_llava_next,
    examples_llava_next,
    row_llava_next,
)
from .qwen2_5_vl import build_qwen2_5_vl, collate_qwen2_5_vl, examples_qwen2_5_vl, row_qwen2_5_vl

TINY_MODELS: dict[str, TinyModel] = {
    "llava": TINY_LLAVA,
    "llava_next": TinyModel(
        "llava_next", build_llava_next, row_llava_next, collate_llava_next, examples_llava_next
    ),
    "qwen2_5_vl": TinyModel(
        "qwen2_5_vl", build_qwen2_5_vl, row_qwen2_5_vl, collate_qwen2_5_vl, examples_qwen2_5_vl
    ),
    "internvl": TinyModel(
        "internvl", build_internvl, row_internvl, TINY_LLAVA.collate, examples_internvl
    ),
    "fuyu": TinyModel(
        "fuyu",
        build_fuyu,
        row_fuyu,
        collate_fuyu,
        examples_fuyu,
        adapter_options={"newline_token_id": NEWLINE},
        beam_search="transformers does not expand Fuyu's pre-encoded patches for beams "
        "(the unhooked model fails with 'Image features and image tokens do not match')",
    ),
    "gemma3": TinyModel("gemma3", gemma3.build, gemma3.row, gemma3.collate, gemma3.examples),
    "llava_onevision": TinyModel(
        "llava_onevision",
        llava_onevision.build,
        llava_onevision.row,
        llava_onevision.collate,
        llava_onevision.examples,
    ),
    "llava_next_video": TinyModel(
        "llava_next_video",
        llava_next_video.build,
        llava_next_video.row,
        llava_next_video.collate,
        llava_next_video.examples,
    ),
    "qwen2_vl": TinyModel(
        "qwen2_vl", qwen2_vl.build, qwen2_vl.row, qwen2_vl.collate, qwen2_vl.examples
    ),
    "qwen3_vl": TinyModel(
        "qwen3_vl", qwen3_vl.build, qwen3_vl.row, qwen3_vl.collate, qwen3_vl.examples
    ),
    "mistral3": TinyModel(
        "mistral3", pixtral.build_mistral3, pixtral.row, pixtral.collate, pixtral.examples
    ),
    "pixtral": TinyModel(
        "pixtral", pixtral.build_pixtral_llava, pixtral.row, pixtral.collate, pixtral.examples
    ),
    "idefics3": TinyModel(
        "idefics3", idefics3.build_idefics3, idefics3.row, idefics3.collate, idefics3.examples
    ),
    "smolvlm": TinyModel(
        "smolvlm", idefics3.build_smolvlm, idefics3.row, idefics3.collate, idefics3.examples
    ),
}
