"""`PreLLMThenLayer` (``pre_llm_then_layer``): a stage on the embeddings, then one after a
decoder layer at a relative depth (VScan's two stages)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .core import ScheduleError, Scheduler, StageSpec, check_fraction
from .knob import REACH_TOLERANCE, check_target, out_of_reach, stage_cap

__all__ = ["PreLLMThenLayer"]


@Scheduler.register("pre_llm_then_layer")
@dataclass
class PreLLMThenLayer(Scheduler):
    """Two stages: stage 0 before decoder layer 0 (every layer caches what it keeps), stage
    1 after decoder layer ``max(0, round(depth * L) - 1)`` of an ``L``-layer model, i.e.
    before layer ``round(depth * L)`` (VScan's ``layer_list [16]`` on 32 layers at
    ``depth = 0.5``; 14 of Qwen2.5-VL's 28). Both stages see one window per image; a
    preset gives stage 1 its own policies with ``stage_overrides``. A stage after layer
    ``l`` reads its relevance from layer ``l``'s projections of that layer's input; VScan's
    code (``VScan/llava/model/modeling_llama_x.py``, ``forward``: ``rank_layer = layer_idx +
    1``; ``layer_prune``: ``self.layers[rank_layer].self_attn``, the last prompt token's
    attention averaged over heads) projects the next layer's input with the next layer's
    query and key: the same tokens are ranked, by one layer earlier's attention here.

    The vision KV kept, averaged over layers, is ``k0 ((l + 1) + (L - l - 1) k1) / L`` with
    ``k0 = 1 - removal_ratio``, ``k1 = 1 - later_removal_ratio`` and ``l`` stage 1's layer.

    Attributes:
        removal_ratio: stage 0's removal ratio, in ``[0, 1)``.
        depth: stage 1's relative depth, in ``(0, 1]``.
        later_removal_ratio: stage 1's removal ratio, in ``[0, 1)``.
    """

    removal_ratio: float = 5 / 6
    depth: float = 0.5
    later_removal_ratio: float = 2 / 3

    def __post_init__(self) -> None:
        check_fraction(self.removal_ratio, "removal_ratio", False, True, "removal ratio")
        check_fraction(
            self.later_removal_ratio, "later_removal_ratio", False, True, "later removal ratio"
        )
        if (
            isinstance(self.depth, bool)
            or not isinstance(self.depth, (int, float))
            or not 0.0 < float(self.depth) <= 1.0
        ):
            raise ScheduleError(f"depth must be in (0, 1], got {self.depth!r}", "depth")

    def max_stages(self) -> int:
        return 2

    def later_layer(self, num_layers: int) -> int:
        """Stage 1's layer on ``num_layers`` layers."""
        return max(0, round(float(self.depth) * num_layers) - 1)

    def plan(self, num_layers):
        self._check_depth(num_layers)
        first = StageSpec(0, float(self.removal_ratio), windows_per_side=1, mode="pre_llm")
        later = StageSpec(
            self.later_layer(num_layers), float(self.later_removal_ratio), windows_per_side=1
        )
        return self._validate([first, later], num_layers)

    def share(self, num_layers: int) -> float:
        """The vision KV the later stage leaves of what stage 0 keeps, averaged over
        ``num_layers`` layers: ``((l + 1) + (L - l - 1) k1) / L``."""
        later = self.later_layer(num_layers)
        k1 = 1.0 - float(self.later_removal_ratio)
        return (later + 1 + (num_layers - later - 1) * k1) / num_layers

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """Both stages where they are; the later stage keeps its ratio, and stage 0 (before
        the LLM) keeps ``kept_fraction / share`` (`share`).

        Raises:
            KeptFractionOutOfReach: a target above `share` (stage 0 removing nothing) or
                below what stage 0 at its policies' limit keeps, by more than
                `REACH_TOLERANCE`.
        """
        t = check_target(kept_fraction)
        self._check_depth(num_layers)
        share = self.share(num_layers)
        limit = stage_cap(max_removal_ratio, 0, self.plan(num_layers)[0])
        kept = t / share
        if kept > 1.0:
            if t - share > REACH_TOLERANCE:
                how = (
                    f"its later stage after layer {self.later_layer(num_layers)} at removal "
                    f"ratio {float(self.later_removal_ratio):.3g} (the first removing nothing)"
                )
                raise out_of_reach(t, share, num_layers, how)
            kept = 1.0
        elif 1.0 - kept > limit:
            lowest = (1.0 - limit) * share
            if lowest > t + REACH_TOLERANCE:
                how = (
                    f"its first stage (removal ratio at most {limit:g}) and its later stage at "
                    f"{float(self.later_removal_ratio):.3g}"
                )
                raise out_of_reach(t, lowest, num_layers, how)
            kept = 1.0 - limit
        return replace(self, removal_ratio=round(1.0 - kept, 6))

    def knob(self) -> str:
        return (
            "the removal ratio of its first stage (before the LLM); the later stage keeps its "
            f"depth {float(self.depth):g} and ratio {float(self.later_removal_ratio):.3g}"
        )
