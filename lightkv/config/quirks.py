"""`ReleasedQuirksConfig`: the released code's quirks as validated data."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool

__all__ = ["ReleasedQuirksConfig"]


class ReleasedQuirksConfig(BaseModel):
    """`lightkv.quirks.ReleasedQuirks` as validated data (``released_quirks:`` in YAML)."""

    model_config = ConfigDict(extra="forbid")

    renumber_positions: StrictBool = Field(
        False,
        description="After every merge the later prefill layers see plain positions 0..N'-1 over "
        "each row's survivors (on Qwen2.5-VL on all three M-RoPE axes); decoding keeps the model's "
        "own positions.",
    )
    unmasked_first_merge: StrictBool = Field(
        False,
        description="The decoder layer whose output the first stage merges attends without a "
        "causal mask during prefill (every real token to every real token of its row).",
    )
    eager_merge_layers: StrictBool = Field(
        False,
        description="Every decoder layer whose output a stage merges computes its attention during "
        "prefill with transformers' eager attention (softmax in float32), as the released code "
        "does; float64 logits then equal the released code's bit for bit. Decoding and the other "
        "layers keep the model's implementation.",
    )
