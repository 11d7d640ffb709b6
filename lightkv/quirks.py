"""`ReleasedQuirks`: what the authors' released LightKV code does inside a model that the
method as written does not, each as an option (all off by default and in every preset but
``lightkv-paper-released`` and ``lightkv-paper-released-qwen2_5_vl``).

Only a `lightkv.adapters.session.CompressionSession` acts on them (positions and masks
exist only inside a model); `lightkv.Pipeline.run` and the pure `lightkv.Stage` are the
same either way. The two relevance / budget quirks are policy parameters instead: the
``random`` relevance (`lightkv.policies.RandomRelevance`) and the divergence pruner's
``budget_dtype: float32``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ReleasedQuirks", "RELEASED_FAMILIES"]

RELEASED_FAMILIES: tuple[str, ...] = ("llava", "qwen2_5_vl")
"""The adapter families the released code supports (LLaVA-1.5 and Qwen2.5-VL); the quirks
are refused on any other."""


@dataclass(frozen=True)
class ReleasedQuirks:
    """Model-level behaviours of the authors' released code, reproduced on request.

    Attributes:
        renumber_positions: after every merge, the later layers of the prefill see plain
            positions ``0 .. N'-1`` over each row's surviving tokens, from the first stage
            that removes one of the row's tokens on (on Qwen2.5-VL all three
            M-RoPE axes get that same 1-D index, so the image's 3-D positions are lost),
            while decoding continues at the model's own positions (the original prompt
            length onwards; Qwen's ``rope_deltas``). The released code marks it
            ``# TODO FIX THIS PART``; the method keeps every survivor's original position.
        unmasked_first_merge: during prefill, the decoder layer whose output the first stage
            merges (the first scheduled layer with a ratio above 0: 0-based layer 12 in the
            LLaVA and Qwen2.5-VL schedules) computes its attention with no causal mask: every real
            token attends to every real token of its row (padding stays hidden). This is
            what the released lmms-eval wrapper does with sdpa models, whose first merge
            layer falls back to eager attention without a mask. Its keys and values, and so
            its cache, are unchanged; every other layer and every decoding step is causal.
        eager_merge_layers: during prefill, every decoder layer whose output a stage merges
            (each scheduled layer with a ratio above 0) computes its attention with
            transformers' eager attention function instead of the model's configured one,
            as the released code does (it asks those layers for their attention weights, which makes
            an sdpa model fall back to eager there). Eager attention takes its softmax in float32
            and casts the probabilities back to the model dtype, so in float64 those layers'
            attention probabilities carry float32 rounding (about 6e-8 relative), exactly as in the
            released code; with it on, float64 logits equal the released code's eager path bit for
            bit, with it off they differ by that rounding (issue 40 measured 6.6e-7 on
            Qwen2.5-VL-7B's logits). Switched per call on the attention modules of this model
            instance only (their ``config`` is replaced by a view that names ``eager`` while the
            call runs, then put back); decoding and every other layer keep the configured
            implementation. It materialises the layer's ``H x N x N`` scores, as the released code
            does.
    """

    renumber_positions: bool = False
    unmasked_first_merge: bool = False
    eager_merge_layers: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(f"ReleasedQuirks.{f.name} must be True or False, got {value!r}")

    @property
    def any(self) -> bool:
        """True when at least one quirk is on."""
        return any(getattr(self, f.name) for f in fields(self))

    def enabled(self) -> list[str]:
        """The names of the quirks that are on, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name)]
