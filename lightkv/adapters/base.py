"""The adapter base class: what an adapter author subclasses to add a model family.

To support a new family, read this module and one family module (``llava.py`` is the
shortest; ``qwen2_5_vl.py`` shows M-RoPE and video), then add the family to
`lightkv.adapters.registry.SUPPORTED_FAMILIES`. An `Adapter` says where the model keeps its
decoder layers and how to read a batch's `VisionLayout` from the inputs of its multimodal
forward; `place_images` and `token_runs` find the image placeholders in ``input_ids``.

Everything else (hooks, cache layers with holes, masks, relevance) is internal to
`lightkv.adapters.session` and needs no change for a new family.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..graph.layout import ImageSegment, VisionLayout
from . import masks

__all__ = ["Adapter", "bind_arguments", "place_images", "token_runs"]


class Adapter:
    """Where a model family keeps its decoder layers, and how to read the `VisionLayout`
    of a batch from the inputs of its multimodal forward.

    Subclasses set `family` and `model_types` and implement `build_layout`; most inherit
    the module lookup, which covers ``XForConditionalGeneration.model.language_model.layers``
    and the bare ``XModel.language_model.layers``.

    Attributes:
        model: the model instance the session hooks.
        options: family-specific options (validated by the subclass).
    """

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    options_allowed: ClassVar[tuple[str, ...]] = ()
    cache_layer_types: ClassVar[tuple[type, ...]] = (DynamicLayer,)
    """Cache layer classes (exact types) the session may find in the cache and replace by a
    `MaskedCacheLayer` at a compressed layer; a family whose masks implement a layer's
    semantics (Gemma 3's sliding window) adds that class. Where `DynamicLayer` is listed,
    transformers' quantized layers (``QuantizedCache``) are accepted too."""
    proportional_attention_refused: ClassVar[str | None] = None
    """Why this family cannot add ``log(size)`` to its attention logits through the masks
    below (`lightkv.Pipeline.proportional_attention` is then refused with this reason);
    None: it can (every shipped family)."""
    flash_attention_refused: ClassVar[str | None] = None
    """Why this family's compressed masks cannot run under FlashAttention-2 (a session on a
    model loaded with ``attn_implementation="flash_attention_2"`` is then refused with this
    reason); None: they can."""

    def __init__(self, model: nn.Module, **options: Any):
        unknown = set(options) - set(self.options_allowed)
        if unknown:
            allowed = ", ".join(self.options_allowed) or "none"
            raise TypeError(
                f"adapter {self.family!r} got unknown option(s) {sorted(unknown)}; allowed: "
                f"{allowed}"
            )
        self.model = model
        # a transformers config; each family reads its own fields from it
        self.config: Any = model.config
        self.options = options
        self.multimodal_module()  # a clear TypeError for a model that is not multimodal at all
        try:
            self.check_config()
        except AttributeError as e:  # e.g. a Llama whose config says model_type "llava"
            kind = getattr(self.config, "model_type", "?")
            raise TypeError(
                f"{type(model).__name__} (model_type {kind!r}) is not a {self.family} model as "
                f"lightkv knows it: {e}; pass the vision-language model itself"
            ) from None

    # ---------------------------------------------------------------- modules
    def multimodal_module(self) -> nn.Module:
        """The module whose forward receives ``input_ids`` and the image inputs and calls
        the language model (e.g. ``LlavaModel``)."""
        inner = getattr(self.model, "model", None)
        if isinstance(inner, nn.Module) and isinstance(
            getattr(inner, "language_model", None), nn.Module
        ):
            return inner
        if isinstance(getattr(self.model, "language_model", None), nn.Module):
            return self.model
        raise TypeError(
            f"{type(self.model).__name__}: cannot find the multimodal core (expected "
            "`.model.language_model` or `.language_model`)"
        )

    def language_model(self) -> nn.Module:
        """The decoder stack (``LlamaModel``, ``Qwen2_5_VLTextModel``, ...)."""
        # multimodal_module() checked that this attribute is a Module
        return cast(nn.Module, self.multimodal_module().language_model)

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers, in order."""
        layers = getattr(self.language_model(), "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise TypeError(f"{type(self.language_model()).__name__} has no `.layers` ModuleList")
        return cast(Sequence[nn.Module], layers)  # indexable and sized, not declared a Sequence

    def text_config(self):
        """The decoder's config."""
        return self.language_model().config

    def check_config(self) -> None:
        """Raise a clear error for configurations the adapter cannot handle."""

    def tower_spec(self, layer: int | None = None):
        """Where the vision tower's attention is read (a `lightkv.adapters.tower.TowerSpec`):
        at the layer whose output the projector reads (``layer`` None: relevance policies
        that ``reads_tower``) or at 0-based tower layer ``layer`` (a policy's
        ``tower_layers``). Default: refused; the LLaVA-1.5 adapter (a CLIP or SigLIP tower, one
        pass per image) implements it.

        Raises:
            NotImplementedError: the adapter does not expose its tower.
            IndexError: the tower has no layer ``layer`` (the message says how many it has).
        """
        raise NotImplementedError(
            "tower relevance (e.g. tower_attention, VisionZip) reads the vision tower's "
            f"attention, which the {self.family!r} adapter does not expose; supported: llava "
            "(LLaVA-1.5)"
        )

    def check_stages(self, stages: Sequence[Any]) -> None:
        """Raise a clear error for a schedule this model cannot run exactly.

        The session calls it once, with the pipeline's stages (`lightkv.Stage`) for this model's
        decoder layers (``stage.spec.layer`` is the layer whose output the stage
        compresses). Default: every schedule is accepted. Qwen3-VL refuses stages before
        its DeepStack layers have added their visual features."""

    def check_cache_layers(self, layers: Sequence[int]) -> None:
        """Raise a clear error when the cache mode (cache stages, H2O eviction) cannot run
        exactly on these decoder layers' caches. Default: every layer can (the mode never
        changes hidden states). Gemma 3 refuses its sliding-window layers."""

    def require_default_feature_strategy(self) -> None:
        """Refuse ``vision_feature_select_strategy`` other than ``"default"`` (CLS dropped):
        with ``"full"`` the CLS token would sit in the grid and break its geometry."""
        strategy = getattr(self.config, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise NotImplementedError(
                f"the {self.family} adapter supports vision_feature_select_strategy='default' (CLS "
                f"dropped, a regular grid); this model uses {strategy!r}"
            )

    # ---------------------------------------------------------------- masks
    # The masks of the layers after a compression stage. The defaults (causal by original
    # order, holes hidden) suit a decoder whose layers all use the same plain causal mask;
    # a family with other attention patterns (bidirectional image blocks, sliding windows)
    # overrides them. ``origin`` is the original sequence column of each token (``-1``
    # holes): prompt columns, then ``prompt length + step`` for generated tokens.
    def mask_key(self, layer: int) -> Hashable:
        """Layers with equal keys share one prefill mask (computed once per stage)."""
        return None

    def prefill_mask(
        self, layer: int, origin: torch.Tensor, valid: torch.Tensor, impl: str, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The 4-D mask of decoder layer ``layer`` over a compressed prefill sequence
        (``origin``, ``valid`` ``[B, N]``); see `lightkv.adapters.masks.prefill_mask`."""
        return masks.prefill_mask(origin, valid, impl, dtype)

    def decode_mask(
        self,
        layer: int,
        origin: torch.Tensor | None,
        valid: torch.Tensor,
        q_len: int,
        impl: str,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The 4-D mask of ``q_len`` new tokens over compressed layer ``layer``'s cache
        (``origin``, ``valid`` ``[B, L]``, the new tokens last; ``origin`` None where the cache
        keeps no positions); see `lightkv.adapters.masks.decode_mask`."""
        return masks.decode_mask(valid, q_len, impl, dtype)

    # ---------------------------------------------------------------- layout
    def build_layout(
        self, inputs: Mapping[str, Any], padding: torch.Tensor | None
    ) -> VisionLayout | None:
        """The layout of one prefill batch.

        Args:
            inputs: the multimodal forward's arguments by name (``input_ids``,
                ``attention_mask``, ``pixel_values``, ``image_sizes``, ``image_grid_thw``, ...).
            padding: ``[B, N]`` bool, True at padding positions (or None).

        Returns:
            the layout, or None when the batch holds no vision tokens.
        """
        raise NotImplementedError

    def reference_layout(
        self, inputs: Mapping[str, Any], padding: torch.Tensor | None
    ) -> VisionLayout | None:
        """The layout of one prefill batch as the authors' code lays it out (what a session
        uses for a pipeline with ``layout: reference``, `lightkv.Pipeline.layout`); same
        arguments as `build_layout`. Default: the native layout (the families whose
        reference code agrees with it); LLaVA-NeXT overrides it."""
        return self.build_layout(inputs, padding)

    @staticmethod
    def layout_from_segments(
        input_ids: torch.Tensor, segments: Sequence[ImageSegment], padding: torch.Tensor | None
    ) -> VisionLayout | None:
        """A layout for ``input_ids`` ``[B, N]`` with the given image segments (None if empty)."""
        if not segments:
            return None
        b, n = input_ids.shape
        return VisionLayout.from_segments(
            b, n, segments, padding_mask=padding, device=input_ids.device
        )

    def square_tiles_layout(
        self, inputs: Mapping[str, Any], padding: torch.Tensor | None, side: int
    ) -> VisionLayout | None:
        """The layout of a prompt whose image placeholders are consecutive ``side x side``
        tiles, each its own grid (InternVL, Idefics3); None without image tokens.

        Raises:
            ValueError: the placeholder count is not a whole number of tiles.
        """
        input_ids = inputs["input_ids"]
        placeholders = input_ids == self.config.image_token_id
        n = int(placeholders.sum())
        if n == 0:
            return None
        per_tile = side * side
        if n % per_tile:
            raise ValueError(
                f"{n} image tokens is not a multiple of {per_tile} tokens per tile ({side}x{side})"
            )
        places = place_images(placeholders, [per_tile] * (n // per_tile), "tile")
        segments = [ImageSegment(row=r, offset=o, grid=(side, side)) for r, o in places]
        return self.layout_from_segments(input_ids, segments, padding)


def bind_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """A forward's arguments by name (positional ones bound through ``signature``, a
    ``**kwargs`` catch-all flattened), as a forward pre-hook sees them."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    out = dict(bound.arguments)
    extra = out.pop("kwargs", None)
    if isinstance(extra, dict):
        out.update(extra)
    return out


def place_images(
    token_mask: torch.Tensor, counts: Sequence[int], what: str = "image"
) -> list[tuple[int, int]]:
    """Where consecutive images sit, given the placeholder mask and each image's token count.

    Models fill placeholders in flattened (row-major) order, image after image, so image
    ``k`` occupies the next ``counts[k]`` placeholder positions. Each image must lie inside
    one batch row, contiguously.

    Args:
        token_mask: ``[B, N]`` bool, True at placeholder tokens.
        counts: tokens per image, in order.

    Returns:
        ``(row, offset)`` per image.

    Raises:
        ValueError: the counts do not add up to the placeholders, or an image is split.
    """
    pos = token_mask.nonzero().cpu()
    total = int(sum(int(c) for c in counts))
    if total != pos.shape[0]:
        raise ValueError(
            f"the prompt has {pos.shape[0]} {what} placeholder tokens but the {what} inputs "
            f"describe {total} ({len(counts)} {what}(s) of {list(counts)} tokens)"
        )
    out, start = [], 0
    for k, c in enumerate(counts):
        c = int(c)
        if c == 0:
            continue
        seg = pos[start : start + c]
        row, first, last = int(seg[0, 0]), int(seg[0, 1]), int(seg[-1, 1])
        if int(seg[-1, 0]) != row or last - first != c - 1:
            raise ValueError(
                f"{what} {k} ({c} tokens) is not one contiguous run of placeholders in one batch "
                "row"
            )
        out.append((row, first))
        start += c
    return out


def token_runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of True in a ``[B, N]`` bool mask: ``(row, start, length)`` in row-major
    order."""
    m = mask.to(torch.int8).cpu()
    pad = torch.zeros(m.shape[0], 1, dtype=torch.int8)
    d = torch.diff(torch.cat([pad, m, pad], dim=1), dim=1)
    starts = (d == 1).nonzero().tolist()
    ends = (d == -1).nonzero().tolist()
    return [(r, s, e - s) for (r, s), (_, e) in zip(starts, ends)]
