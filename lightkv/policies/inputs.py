"""`StageInputs`: everything a stage knows, handed to every policy that wants it.

A stage builds one `StageInputs` and gives it to its partitioner (``partition``), its edge
scorer (``score``) and, through `PruneInputs.stage`, its pruner. A policy reads what it
needs and ignores the rest, so a relevance-driven split or a key-space divergence is a
policy, not a copy of the stage:

```python
from lightkv.policies import StageInputs
inputs = StageInputs.of(layout, windows_per_side=2)        # layout-only, e.g. in a test
inputs.features("key_states")                               # [B, N, H_kv, d] or a clear error
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..graph.layout import VisionLayout
from ..graph.provenance import Provenance
from .prompt import Prompt
from .schedulers import StageSpec

__all__ = ["Features", "StageInputs"]

Features = Literal["hidden", "key_states"]
"""Per-token features a policy can ask for: the residual stream (``hidden``) or the layer's
keys per token (``key_states``, `StageInputs.key_states`; not the post-RoPE ``[B, H_kv, N, d]``
keys a relevance policy scores with, `lightkv.policies.Relevance.score`)."""

FEATURES: tuple[str, ...] = ("hidden", "key_states")


@dataclass(frozen=True)
class StageInputs:
    """The inputs of one compression stage.

    Attributes:
        layout: the batch layout (``[B, N]`` tokens).
        spec: the stage's schedule entry (layer, removal ratio, windows).
        hidden: ``[B, N, D]`` hidden states after the stage's layer (None only when the
            inputs describe a layout alone, e.g. to call a partitioner in a test).
        relevance: ``[B, N]`` prompt relevance ξ (non-negative), or None for uniform.
        key_states: ``[B, N, H_kv, d]`` the layer's attention keys per token (before RoPE;
            a cache stage's are its cached entries), when the adapter computed them (it does
            when a policy `needs` them), else None.
        provenance: which current token represents each original token (None: the
            sequence is original).
        prompt: the prefill's token ids (a `Prompt`; adapters pass it from ``input_ids``),
            for policies conditioned on what the prompt says (e.g. CDPruner's instruction
            relevance reads the question's embeddings through ``prompt.question_mask``);
            None when the caller has no ids.
        tower: ``{layer: [B, H, N]}``: the attention each current token's patch received
            per head inside the vision tower at the 0-based tower layers the stage's policies
            name in ``tower_layers`` (adapters compute it for those), else None.
    """

    layout: VisionLayout
    spec: StageSpec
    hidden: torch.Tensor | None = None
    relevance: torch.Tensor | None = None
    key_states: torch.Tensor | None = None
    provenance: Provenance | None = None
    prompt: Prompt | None = None
    divergence_budget: int | None = None
    """Bytes an edge scorer's pairwise intermediates may take at once (the pipeline's
    ``divergence_memory_mib``); None: `lightkv.policies.scorers.DEFAULT_DIVERGENCE_BYTES`."""
    tower: dict[int, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        layout: VisionLayout,
        hidden: torch.Tensor | None = None,
        *,
        windows_per_side: int | None = None,
        window_size: tuple[int, int] | None = None,
        removal_ratio: float = 0.5,
        layer: int = 0,
        **tensors: torch.Tensor | Provenance | Prompt | None,
    ) -> StageInputs:
        """Inputs for a stage built from a layout and window settings, without a scheduler.

        ``tensors`` are the other fields (``relevance``, ``key_states``, ``provenance``,
        ``prompt``, ``tower``).

        Raises:
            TypeError: ``ratio`` (renamed ``removal_ratio``) or another unknown keyword.
        """
        if "ratio" in tensors:
            raise TypeError("StageInputs.of: 'ratio' was renamed; use 'removal_ratio'")
        spec = StageSpec(
            layer, removal_ratio, windows_per_side=windows_per_side, window_size=window_size
        )
        return cls(layout=layout, spec=spec, hidden=hidden, **tensors)  # type: ignore[arg-type]

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.layout.batch_size

    @property
    def seq_len(self) -> int:
        """``N``."""
        return self.layout.seq_len

    @property
    def sizes(self) -> torch.Tensor:
        """``[B, N]`` int64: how many original tokens each current token represents."""
        if self.provenance is None:
            return torch.ones(self.layout.kind.shape, dtype=torch.long, device=self.layout.device)
        return self.provenance.sizes()

    def features(self, kind: str) -> torch.Tensor:
        """Per-token features by name: ``"hidden"`` ``[B, N, D]`` or ``"key_states"``
        ``[B, N, H_kv, d]``.

        This is the one place that maps a policy's ``features`` setting to a tensor.

        Raises:
            ValueError: an unknown name, or features the caller did not provide.
        """
        if kind not in FEATURES:
            raise ValueError(f"unknown features {kind!r}; choose one of {', '.join(FEATURES)}")
        value = self.hidden if kind == "hidden" else self.key_states
        if value is None:
            how = (
                "pass hidden=[B, N, D]"
                if kind == "hidden"
                else "pass key_states=[B, N, H_kv, d] to the stage (adapters do when a policy "
                "needs them)"
            )
            raise ValueError(f"this stage has no {kind} features: {how}")
        return value

    def check(self) -> None:
        """Shape checks that name the problem (the stage calls this once).

        Raises:
            TypeError, ValueError: a tensor of the wrong kind or shape.
        """
        b, n = self.layout.batch_size, self.layout.seq_len
        if self.hidden is not None:
            if not isinstance(self.hidden, torch.Tensor) or self.hidden.dim() != 3:
                shape = (
                    tuple(self.hidden.shape)
                    if isinstance(self.hidden, torch.Tensor)
                    else type(self.hidden).__name__
                )
                raise ValueError(f"hidden states must be [B, N, D], got shape {shape}")
            if tuple(self.hidden.shape[:2]) != (b, n):
                raise ValueError(
                    f"hidden states {tuple(self.hidden.shape)} do not match the layout [B={b}, "
                    f"N={n}]"
                )
            if not self.hidden.is_floating_point():
                raise TypeError(f"hidden states must be floating point, got {self.hidden.dtype}")
        if self.relevance is not None and tuple(self.relevance.shape) != (b, n):
            raise ValueError(
                f"relevance must be [B, N] = {(b, n)}, got {tuple(self.relevance.shape)}"
            )
        if self.prompt is not None and self.prompt.token_ids.shape[0] != b:
            raise ValueError(
                f"the prompt has {self.prompt.token_ids.shape[0]} rows, the layout {b}"
            )
        for layer, att in (self.tower or {}).items():
            if not isinstance(att, torch.Tensor) or att.dim() != 3 or att.shape[::2] != (b, n):
                raise ValueError(
                    f"tower attention of layer {layer} must be [B, H, N] with B, N = {(b, n)}, got "
                    f"{tuple(att.shape) if isinstance(att, torch.Tensor) else type(att).__name__}"
                )
        if self.key_states is not None:
            ks = self.key_states
            if ks.dim() not in (3, 4) or tuple(ks.shape[:2]) != (b, n):
                raise ValueError(
                    "key_states must be [B, N, H_kv, d] (or [B, N, d] for one head) with B, N = "
                    f"{(b, n)}, got {tuple(ks.shape)}"
                )

    def __post_init__(self) -> None:
        # One shape for every policy: a [B, N, d] key tensor is one head.
        if isinstance(self.key_states, torch.Tensor) and self.key_states.dim() == 3:
            object.__setattr__(self, "key_states", self.key_states.unsqueeze(2))
