"""Model-agnostic machinery: compress vision tokens inside the prefill of an unmodified
``transformers`` vision-language model.

`CompressionSession` is a context manager. On entry it installs hooks on *one* model
instance (nothing is patched at class level, nothing happens at import); on exit, also
when an exception escapes, it removes them. While it is active, every forward of the model
(a plain ``model(...)`` call or each step of ``model.generate(...)``) goes through:

* a forward pre-hook on the multimodal core (e.g. ``LlavaModel``): reads the inputs
  (``input_ids``, ``attention_mask``, image sizes / grids) and, for a prefill (empty
  cache), asks the family `Adapter` for the batch's `VisionLayout`;
* a forward pre-hook on every decoder layer: after a compression stage has run it hands
  the layer hidden states, position embeddings (1-D RoPE or Qwen's 3-D M-RoPE), position
  ids and a 4-D attention mask that all describe the *shorter* sequence, and gives the
  layer's cache a `MaskedCacheLayer` that remembers which entries are holes. At a
  scheduled layer it computes prompt relevance ξ from the layer's own projections, for
  only the rows and columns the relevance policy reads (never an ``N x N`` matrix);
* a forward hook on every scheduled layer: runs the pure `lightkv.Stage` on the layer's
  output and returns the stage's shorter hidden states in its place.

During decoding each compressed layer gets a mask built from its own cache (holes hidden);
positions come from the model as usual (the original prompt length onwards), so every
layer continues consistently. Beam search works because the hole masks live in the cache
layers and follow ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``.
"""

from __future__ import annotations

import functools
import gc
import inspect
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ..graph.layout import ImageSegment, TokenKind, VisionLayout
from ..graph.provenance import Provenance
from ..graph.scatter import pack_rows
from ..pipeline import Pipeline, Stage, StageResult
from .probes import AttentionProbe, LayerShape, probe_for_layer

__all__ = [
    "SUPPORTED_ATTENTION",
    "Adapter",
    "CompressionSession",
    "LayerStat",
    "MaskedCacheLayer",
    "PrefillTrace",
    "StageRecord",
    "decode_mask",
    "drop_padding",
    "place_images",
    "prefill_mask",
]

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations the hooks support (a custom 4-D mask must reach the kernel)."""

_ACTIVE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Language models that currently have an active session (one session per model)."""


# ---------------------------------------------------------------------------------------
# Family adapters
# ---------------------------------------------------------------------------------------
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
    layout_mode: str = "native"
    """The session's `lightkv.Pipeline.layout` (``native`` or ``reference``)."""

    def __init__(self, model: nn.Module, **options: Any):
        unknown = set(options) - set(self.options_allowed)
        if unknown:
            allowed = ", ".join(self.options_allowed) or "none"
            raise TypeError(f"adapter {self.family!r} got unknown option(s) {sorted(unknown)}; allowed: {allowed}")
        self.model = model
        self.config = model.config
        self.options = options
        self.check_config()

    # ---------------------------------------------------------------- modules
    def multimodal_module(self) -> nn.Module:
        """The module whose forward receives ``input_ids`` and the image inputs and calls
        the language model (e.g. ``LlavaModel``)."""
        inner = getattr(self.model, "model", None)
        if isinstance(inner, nn.Module) and isinstance(getattr(inner, "language_model", None), nn.Module):
            return inner
        if isinstance(getattr(self.model, "language_model", None), nn.Module):
            return self.model
        raise TypeError(
            f"{type(self.model).__name__}: cannot find the multimodal core (expected `.model.language_model` "
            "or `.language_model`)"
        )

    def language_model(self) -> nn.Module:
        """The decoder stack (``LlamaModel``, ``Qwen2_5_VLTextModel``, ...)."""
        return self.multimodal_module().language_model

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers, in order."""
        layers = getattr(self.language_model(), "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise TypeError(f"{type(self.language_model()).__name__} has no `.layers` ModuleList")
        return layers

    def text_config(self):
        """The decoder's config."""
        return self.language_model().config

    def check_config(self) -> None:
        """Raise a clear error for configurations the adapter cannot handle."""

    def require_default_feature_strategy(self) -> None:
        """Refuse ``vision_feature_select_strategy`` other than ``"default"`` (CLS dropped):
        with ``"full"`` the CLS token would sit in the grid and break its geometry."""
        strategy = getattr(self.config, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise NotImplementedError(
                f"the {self.family} adapter supports vision_feature_select_strategy='default' (CLS dropped, "
                f"a regular grid); this model uses {strategy!r}"
            )

    # ---------------------------------------------------------------- layout
    def build_layout(self, inputs: Mapping[str, Any], padding: torch.Tensor | None) -> VisionLayout | None:
        """The layout of one prefill batch.

        Args:
            inputs: the multimodal forward's arguments by name (``input_ids``,
                ``attention_mask``, ``pixel_values``, ``image_sizes``, ``image_grid_thw``, ...).
            padding: ``[B, N]`` bool, True at padding positions (or None).

        Returns:
            the layout, or None when the batch holds no vision tokens.
        """
        raise NotImplementedError

    @staticmethod
    def layout_from_segments(
        input_ids: torch.Tensor, segments: Sequence[ImageSegment], padding: torch.Tensor | None
    ) -> VisionLayout | None:
        """A layout for ``input_ids`` ``[B, N]`` with the given image segments (None if empty)."""
        if not segments:
            return None
        b, n = input_ids.shape
        return VisionLayout.from_segments(b, n, segments, padding_mask=padding, device=input_ids.device)


def place_images(token_mask: torch.Tensor, counts: Sequence[int], what: str = "image") -> list[tuple[int, int]]:
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
            f"the prompt has {pos.shape[0]} {what} placeholder tokens but the {what} inputs describe {total} "
            f"({len(counts)} {what}(s) of {list(counts)} tokens)"
        )
    out, start = [], 0
    for k, c in enumerate(counts):
        c = int(c)
        if c == 0:
            continue
        seg = pos[start : start + c]
        row, first, last = int(seg[0, 0]), int(seg[0, 1]), int(seg[-1, 1])
        if int(seg[-1, 0]) != row or last - first != c - 1:
            raise ValueError(f"{what} {k} ({c} tokens) is not one contiguous run of placeholders in one batch row")
        out.append((row, first))
        start += c
    return out


def token_runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of True in a ``[B, N]`` bool mask: ``(row, start, length)`` in row-major order."""
    m = mask.to(torch.int8).cpu()
    pad = torch.zeros(m.shape[0], 1, dtype=torch.int8)
    d = torch.diff(torch.cat([pad, m, pad], dim=1), dim=1)
    starts = (d == 1).nonzero().tolist()
    ends = (d == -1).nonzero().tolist()
    return [(r, s, e - s) for (r, s), (_, e) in zip(starts, ends)]


# ---------------------------------------------------------------------------------------
# Cache layer with holes
# ---------------------------------------------------------------------------------------
class _Token:
    """Shared open/closed flag of one session."""

    def __init__(self) -> None:
        self.open = True


class MaskedCacheLayer(DynamicLayer):
    """A `DynamicLayer` of a compressed decoder layer: shorter than the prompt, possibly
    with holes (rows that kept fewer tokens, input padding), recorded in ``valid``.

    ``valid`` (``[B, L]`` bool, True for real entries) follows the cache through beam
    search (`reorder_cache`), `batch_select_indices` and `batch_repeat_interleave`.
    Cropping is refused: compressed layers hold different numbers of entries, so "remove
    the last k tokens" has no single meaning (assisted decoding is not supported).
    """

    is_croppable = False

    def __init__(self, token: _Token | None = None):
        super().__init__()
        self.valid: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self._token = token or _Token()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self._token.open:
            raise RuntimeError(
                "this cache was compressed by a lightkv session that has ended; its compressed layers need the "
                "session's masks: decode inside the `with pipeline.apply(model):` block"
            )
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = self.pending
        if new is None:
            new = torch.ones(key_states.shape[0], key_states.shape[-2], dtype=torch.bool, device=key_states.device)
        self.pending = None
        new = new.to(keys.device)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], dim=1)
        return keys, values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, beam_idx.to(self.valid.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.valid is not None:
            self.valid = self.valid.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.valid is not None:
            self.valid = self.valid[indices]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "a lightkv-compressed cache cannot be cropped (compressed layers hold fewer entries than the prompt); "
            "assisted / speculative decoding and cache rollback are not supported inside a compression session"
        )

    def reset(self) -> None:
        super().reset()
        self.valid = self.pending = None


# ---------------------------------------------------------------------------------------
# Masks and gathers
# ---------------------------------------------------------------------------------------
def _finish_mask(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    allowed = allowed.unsqueeze(1)
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def prefill_mask(origin: torch.Tensor, valid: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The 4-D mask of a compressed sequence: causal by original order, holes hidden.

    Args:
        origin: ``[B, N]`` original index of each token (``-1`` holes).
        valid: ``[B, N]`` bool, False for holes and padding.
        impl: ``"sdpa"`` (bool mask, or None when a plain causal mask is exact) or
            ``"eager"`` (additive float mask).
        dtype: dtype of the additive mask.

    Returns:
        ``[B, 1, N, N]``; an invalid query row attends to itself only, so hole states
        stay finite.
    """
    if impl == "sdpa" and bool(valid.all()):
        return None
    n = origin.shape[1]
    allowed = (origin.unsqueeze(1) <= origin.unsqueeze(2)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    allowed |= torch.eye(n, dtype=torch.bool, device=origin.device)
    return _finish_mask(allowed, impl, dtype)


def decode_mask(valid: torch.Tensor, q_len: int, impl: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The 4-D mask of ``q_len`` new tokens over a compressed layer's cache.

    Args:
        valid: ``[B, L]`` validity of the cached entries followed by the new tokens
            (``L`` includes the ``q_len`` new ones).

    Returns:
        ``[B, 1, q_len, L]`` (None under sdpa for one valid token over a hole-free cache).
    """
    total = valid.shape[1]
    if impl == "sdpa" and q_len == 1 and bool(valid.all()):
        return None
    past = total - q_len
    k = torch.arange(total, device=valid.device)
    qpos = past + torch.arange(q_len, device=valid.device)
    allowed = valid.unsqueeze(1) & (k.unsqueeze(0) <= qpos.unsqueeze(1)).unsqueeze(0)
    allowed |= (k.unsqueeze(0) == qpos.unsqueeze(1)).unsqueeze(0)
    return _finish_mask(allowed, impl, dtype)


def _batch(t: torch.Tensor, b: int) -> torch.Tensor:
    return t.expand(b, *t.shape[1:]) if t.shape[0] != b else t


def gather_tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B or 1, N, ...]`` gathered along the token axis by ``index`` ``[B, M]``."""
    b, m = index.shape
    t = _batch(t, b)
    idx = index.reshape(b, m, *([1] * (t.dim() - 2))).expand(b, m, *t.shape[2:])
    return t.gather(1, idx)


def gather_position_ids(p: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """Position ids ``[B or 1, N]`` or ``[k, B or 1, N]`` (M-RoPE) gathered by ``index``."""
    if p is None:
        return None
    if p.dim() == 1:
        p = p.unsqueeze(0)
    if p.dim() == 2:
        return gather_tokens(p, index)
    if p.dim() == 3:
        k, b = p.shape[0], index.shape[0]
        p = p.expand(k, b, p.shape[2]) if p.shape[1] != b else p
        return p.gather(2, index.unsqueeze(0).expand(k, -1, -1))
    raise ValueError(f"unsupported position_ids shape {tuple(p.shape)}")


def drop_padding(result: StageResult) -> StageResult:
    """The same result without padding columns it does not need.

    A `Stage` keeps every non-removed token, including input padding and holes left by
    earlier stages (kind PAD), so a padded row keeps the batch as wide as the prompt. This
    drops PAD tokens and re-aligns each row's real tokens to the right (holes on the left,
    as few as the longest row needs). Only gathers: hidden states are not changed. A no-op
    when the result has no removable padding.
    """
    keep = result.layout.valid_mask
    b, n = keep.shape
    count = keep.sum(dim=1)
    width = int(count.max()) if b else 0
    if width == n:
        return result
    col = (width - count).unsqueeze(1) + keep.long().cumsum(dim=1) - 1
    col = torch.where(keep, col, torch.full_like(col, -1))  # old column -> new column
    rows = torch.arange(b, device=keep.device).unsqueeze(1).expand(b, n)
    index = torch.full((b, width), -1, dtype=torch.long, device=keep.device)
    index[rows[keep], col[keep]] = torch.arange(n, device=keep.device).expand(b, n)[keep]
    hole = index < 0
    hidden = gather_tokens(result.hidden, index.clamp_min(0)).masked_fill(hole.unsqueeze(-1), 0)
    kept_index = result.kept_index.gather(1, index.clamp_min(0)).masked_fill(hole, -1)

    def through(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 0, col.gather(1, t.clamp_min(0)), t)

    owner = through(result.provenance.owner)
    return StageResult(
        hidden=hidden,
        layout=result.layout.select(index),
        kept_index=kept_index,
        provenance=Provenance(owner, width),
        remap=through(result.remap),
    )


def _last_valid(valid: torch.Tensor) -> torch.Tensor:
    n = valid.shape[1]
    return (valid.long() * torch.arange(1, n + 1, device=valid.device)).argmax(dim=1)


# ---------------------------------------------------------------------------------------
# What a session records
# ---------------------------------------------------------------------------------------
@dataclass
class StageRecord:
    """One stage as it ran inside the model.

    Always present: ``layer``, ``result`` (the `StageResult`). With ``record=True`` also the
    stage's exact inputs, so tests can re-run the pure `Stage` and compare.
    """

    layer: int
    stage: Stage
    result: StageResult
    hidden: torch.Tensor | None = None
    layout: VisionLayout | None = None
    relevance: torch.Tensor | None = None
    provenance: Provenance | None = None
    keys: torch.Tensor | None = None


@dataclass
class LayerStat:
    """Token counts of one decoder layer during a prefill (tensors ``[B]``).

    Attributes:
        layer: index.
        length: width of the layer's input / cache entries (holes included).
        valid: real tokens per row.
        vision: vision tokens per row.
        structural: structural (never merged) image tokens per row.
    """

    layer: int
    length: int
    valid: torch.Tensor
    vision: torch.Tensor
    structural: torch.Tensor


@dataclass
class PrefillTrace:
    """Everything one prefill did (what `lightkv.adapters.report.SessionReport` reads)."""

    batch_size: int
    input_len: int
    layout: VisionLayout | None
    input_valid: torch.Tensor
    layers: list[LayerStat] = field(default_factory=list)
    stages: list[StageRecord] = field(default_factory=list)
    final_layout: VisionLayout | None = None
    provenance: Provenance | None = None
    relevance_flops: float = 0.0
    kv_dtype: torch.dtype | None = None


@dataclass
class _Forward:
    """Per-forward state."""

    mode: str  # "prefill" | "decode"
    impl: str
    layout: VisionLayout | None = None
    new_valid: torch.Tensor | None = None
    provenance: Provenance | None = None
    compressed: bool = False
    full_pos: tuple[torch.Tensor, torch.Tensor] | None = None
    full_pos_ids: torch.Tensor | None = None
    pos: tuple[torch.Tensor, torch.Tensor] | None = None
    pos_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    pending_relevance: torch.Tensor | None = None
    pending_keys: torch.Tensor | None = None
    trace: PrefillTrace | None = None


def _cache_of(kwargs: Mapping[str, Any]):
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


# ---------------------------------------------------------------------------------------
# The session
# ---------------------------------------------------------------------------------------
_COMPILED = (
    "lightkv cannot compress a torch.compile'd model: compiled code does not run the hooks lightkv installs, "
    "so nothing would be compressed. "
)


def _refuse_compiled(model: nn.Module, modules: Sequence[nn.Module] = ()) -> None:
    """Raise when ``model`` (or one of ``modules``) is compiled or wrapped by
    ``torch.compile``: a compiled graph skips module hooks, so a session would silently
    compress nothing."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001  (a torch without dynamo cannot compile either)
        return
    if isinstance(model, OptimizedModule):
        raise TypeError(_COMPILED + "Apply lightkv to the uncompiled model (compiled._orig_mod) and call that one "
                        "inside the with block.")
    targets = [model, *modules]
    for m in targets:
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise TypeError(_COMPILED + f"{type(m).__name__} was compiled in place (module.compile()); set its "
                            "_compiled_call_impl to None, or load the model again, before applying lightkv.")
    if modules:
        # A wrapper made by torch.compile(model) keeps the model as its `_orig_mod`: calling the
        # wrapper inside the session would run the compiled graph, without hooks.
        def wrapped() -> bool:
            return any(isinstance(ref, dict) and any(ref.get("_orig_mod") is t for t in targets)
                       for ref in gc.get_referrers(*targets))

        if wrapped():
            gc.collect()  # a deleted wrapper may only wait for the cycle collector
            if wrapped():
                raise TypeError(_COMPILED + "A torch.compile wrapper of this model exists; delete it "
                                "and call the uncompiled model inside the with block.")


class CompressionSession:
    """Compress vision tokens during prefill of one model, for the duration of a ``with``.

    ```python
    with lightkv.adapters.apply(pipeline, model) as session:
        out = model.generate(**inputs, max_new_tokens=32)
    print(session.report())
    ```

    Args:
        pipeline: what to do (schedule + policies).
        model: a supported transformers vision-language model (see
            `lightkv.adapters.registry.SUPPORTED_FAMILIES`).
        adapter: a family name or an `Adapter` instance (default: detected from
            ``model.config.model_type``).
        record: keep every stage's exact inputs in `records` (for tests and debugging).
        **adapter_options: family-specific options (e.g. Fuyu's ``newline_token_id``).

    Notes:
        * Output sequences of a plain forward are *compressed*: ``logits`` has one column
          per surviving token (right-aligned, holes on the left);
          ``session.last_prefill.final_layout.origin`` maps columns to prompt positions.
        * Only a forward that starts from an empty cache is compressed; continuing a cache
          that this session compressed works (the hole masks are in the cache).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        model: nn.Module,
        *,
        adapter: str | Adapter | None = None,
        record: bool = False,
        **adapter_options: Any,
    ):
        from .registry import get_adapter

        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"expected a lightkv.Pipeline, got {type(pipeline).__name__}")
        _refuse_compiled(model)
        if isinstance(adapter, Adapter):
            if adapter_options:
                raise TypeError("pass adapter options to the Adapter instance, not to the session")
            self.adapter = adapter
        else:
            self.adapter = get_adapter(model, family=adapter, **adapter_options)
        self.pipeline = pipeline
        self.adapter.layout_mode = pipeline.layout  # read by adapters with a reference layout (LLaVA-NeXT)
        self.model = model
        self.record = record
        self._mm = self.adapter.multimodal_module()
        self._lm = self.adapter.language_model()
        self.layers = list(self.adapter.decoder_layers())
        _refuse_compiled(model, [self._mm, self._lm, *self.layers])
        self.num_layers = len(self.layers)
        self.stages = pipeline.stages(self.num_layers)
        self._stage_at = {s.spec.layer: s for s in self.stages}
        self._probes: list[AttentionProbe] = [probe_for_layer(layer) for layer in self.layers]
        self.layer_shapes: list[LayerShape] = [p.shape() for p in self._probes]
        self._signature = inspect.signature(self._mm.forward)
        self._attn_impl()  # fail early on unsupported attention
        self._handles: list[Any] = []
        self._owner = False
        self._token = _Token()
        self._token.open = False
        self._state: _Forward | None = None
        self.last_prefill: PrefillTrace | None = None
        self.num_prefills = 0
        self.num_forwards = 0

    # ---------------------------------------------------------------- context manager
    @property
    def active(self) -> bool:
        """True inside the ``with`` block."""
        return bool(self._handles)

    def __enter__(self) -> CompressionSession:
        if self._lm in _ACTIVE:
            raise RuntimeError(
                f"a lightkv compression session is already active on this {type(self.model).__name__}; "
                "exit it before applying another pipeline"
            )
        try:
            self._handles.append(self._mm.register_forward_pre_hook(self._on_model_pre, with_kwargs=True))
            self._handles.append(
                self._mm.register_forward_hook(self._on_model_post, with_kwargs=True, always_call=True)
            )
            for i, layer in enumerate(self.layers):
                self._handles.append(
                    layer.register_forward_pre_hook(functools.partial(self._on_layer_pre, i), with_kwargs=True)
                )
                if i in self._stage_at:
                    self._handles.append(
                        layer.register_forward_hook(functools.partial(self._on_layer_post, i), with_kwargs=True)
                    )
        except BaseException:
            self._remove()
            raise
        self._token = _Token()
        _ACTIVE.add(self._lm)
        self._owner = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._remove()

    def close(self) -> None:
        """Remove the hooks (what leaving the ``with`` block does)."""
        self._remove()

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._token.open = False
        self._state = None
        if self._owner:
            _ACTIVE.discard(self._lm)
            self._owner = False

    # ---------------------------------------------------------------- results
    @property
    def records(self) -> list[StageRecord]:
        """The stages of the last prefill."""
        return list(self.last_prefill.stages) if self.last_prefill else []

    def to_prompt_positions(self, t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Put a per-token output of the last prefill (``[B, N', ...]``, e.g. ``logits``)
        back at the prompt positions its tokens came from: ``[B, N0, ...]``, ``fill`` where
        a prompt token no longer has its own column (merged, dropped or padding)."""
        trace = self.last_prefill
        if trace is None:
            raise RuntimeError("no prefill has run in this session")
        layout = trace.final_layout
        if layout is None:
            return t
        origin = layout.origin
        if t.shape[:2] != origin.shape:
            raise ValueError(f"expected [B, N'] = {tuple(origin.shape)} leading dims, got {tuple(t.shape)}")
        out = t.new_full((t.shape[0], trace.input_len, *t.shape[2:]), fill)
        b, n = origin.shape
        rows = torch.arange(b, device=origin.device).unsqueeze(1).expand(b, n)
        keep = origin >= 0
        out[rows[keep], origin[keep]] = t[keep]
        return out

    def report(self):
        """A `lightkv.adapters.report.SessionReport` of the last prefill."""
        from .report import SessionReport

        return SessionReport.from_session(self)

    # ---------------------------------------------------------------- helpers
    def _attn_impl(self) -> str:
        impl = getattr(self._lm.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"lightkv needs attn_implementation in {SUPPORTED_ATTENTION} (the compressed layers need a custom "
                f"4-D mask); this model uses {impl!r}. Load it with attn_implementation='sdpa'."
            )
        return impl

    def _bind(self, args, kwargs) -> dict[str, Any]:
        try:
            bound = self._signature.bind_partial(*args, **kwargs)
        except TypeError:
            return dict(kwargs)
        out = dict(bound.arguments)
        extra = out.pop("kwargs", None)
        if isinstance(extra, dict):
            out.update(extra)
        return out

    # ---------------------------------------------------------------- model hooks
    def _on_model_pre(self, module, args, kwargs):
        self._state = None
        inputs = self._bind(args, kwargs)
        input_ids = inputs.get("input_ids")
        embeds = inputs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        if ref is None:
            return
        b, q = ref.shape[:2]
        impl = self._attn_impl()
        cache = _cache_of(inputs)
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError("lightkv supports transformers Cache objects only (legacy tuple caches are not supported)")
        if cache is not None:
            # before the mask check: with a static cache transformers prepares a 4-D mask itself
            bad = next((layer for layer in getattr(cache, "layers", ())
                        if type(layer) is not DynamicLayer and not isinstance(layer, MaskedCacheLayer)), None)
            if bad is not None:
                raise TypeError(
                    f"lightkv supports the default dynamic cache only; this {type(cache).__name__} has "
                    f"{type(bad).__name__} layers (static, sliding-window, quantized and offloaded caches are not "
                    "supported): drop cache_implementation= or past_key_values="
                )
        past = cache.get_seq_length() if cache is not None else 0
        mask2d = inputs.get("attention_mask")
        if mask2d is not None and (not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2):
            raise ValueError(
                f"lightkv needs a 2-D attention_mask [batch, sequence] (or none); got a {mask2d.dim()}-D mask. Pass the "
                "processor's attention_mask as it is" if isinstance(mask2d, torch.Tensor) else
                f"lightkv needs a 2-D attention_mask [batch, sequence] (or none); got {type(mask2d).__name__}"
            )
        new_valid = (
            mask2d[:, -q:].bool() if mask2d is not None else torch.ones(b, q, dtype=torch.bool, device=ref.device)
        )
        self.num_forwards += 1
        if past > 0:
            self._state = _Forward(mode="decode", impl=impl, new_valid=new_valid)
            return
        layout = None
        if input_ids is not None:
            padding = ~new_valid if mask2d is not None and not bool(new_valid.all()) else None
            layout = self.adapter.build_layout(inputs, padding)
        elif any(inputs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
            raise ValueError(
                "lightkv needs input_ids to find the vision tokens; call the model with input_ids, not inputs_embeds"
            )
        if layout is not None and not bool(layout.vision_mask.any()):
            layout = None
        trace = PrefillTrace(batch_size=b, input_len=q, layout=layout, input_valid=new_valid)
        self._state = _Forward(mode="prefill", impl=impl, layout=layout, new_valid=new_valid, trace=trace)
        self.num_prefills += 1
        return

    def _on_model_post(self, module, args, kwargs, output):
        st = self._state
        self._state = None
        if st is not None and st.mode == "prefill" and st.trace is not None:
            st.trace.final_layout = st.layout
            st.trace.provenance = st.provenance
            self.last_prefill = st.trace

    # ---------------------------------------------------------------- layer hooks
    def _on_layer_pre(self, i: int, module, args, kwargs):
        st = self._state
        if st is None:
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        cache = _cache_of(kwargs)
        if st.mode == "decode":
            if cache is None or len(cache.layers) <= i or not isinstance(cache.layers[i], MaskedCacheLayer):
                return None
            layer_cache = cache.layers[i]
            if layer_cache.valid is None:
                return None
            valid = torch.cat([layer_cache.valid, st.new_valid.to(layer_cache.valid.device)], dim=1)
            kwargs["attention_mask"] = decode_mask(valid, hidden.shape[1], st.impl, hidden.dtype)
            layer_cache.pending = st.new_valid
            return args, kwargs

        # ---- prefill
        trace = st.trace
        if trace.kv_dtype is None:
            trace.kv_dtype = hidden.dtype
        layout = st.layout
        if layout is None:
            valid = st.new_valid
            zeros = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
            trace.layers.append(LayerStat(i, hidden.shape[1], valid.sum(1), zeros, zeros))
            return None
        if hidden.shape[1] != layout.seq_len:
            raise RuntimeError(
                f"layer {i} received {hidden.shape[1]} tokens but the layout has {layout.seq_len}; "
                "the model's forward does not match what the adapter expects"
            )
        kind = layout.kind
        trace.layers.append(
            LayerStat(
                i,
                layout.seq_len,
                layout.valid_mask.sum(1),
                (kind == TokenKind.VISION).sum(1),
                (kind == TokenKind.STRUCTURAL).sum(1),
            )
        )
        if not st.compressed:
            st.full_pos = kwargs.get("position_embeddings")
            st.full_pos_ids = kwargs.get("position_ids")
        else:
            kwargs["attention_mask"] = st.mask
            if st.pos is not None:
                kwargs["position_embeddings"] = st.pos
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = st.pos_ids
            if cache is not None:
                self._masked_layer(cache, i).pending = layout.valid_mask
        stage = self._stage_at.get(i)
        if stage is not None:
            with torch.no_grad():
                st.pending_relevance = self._relevance(i, stage, hidden, kwargs.get("position_embeddings"), layout)
                st.pending_keys = None
                if stage.scorer is not None and stage.scorer.features == "keys":
                    probe = self._probes[i]
                    k = probe.keys(probe.normed(hidden), None, None)  # [B, Hkv, N, d], pre-RoPE
                    st.pending_keys = k.transpose(1, 2).flatten(2)
        return args, kwargs

    def _on_layer_post(self, i: int, module, args, kwargs, output):
        st = self._state
        if st is None or st.mode != "prefill" or st.layout is None:
            return None
        stage = self._stage_at[i]
        hidden = output[0] if isinstance(output, tuple) else output
        layout, provenance = st.layout, st.provenance
        relevance, keys = st.pending_relevance, st.pending_keys
        result = drop_padding(stage(hidden, layout, relevance, provenance, keys))
        record = StageRecord(layer=i, stage=stage, result=result)
        if self.record:
            record.hidden, record.layout, record.relevance = hidden, layout, relevance
            record.provenance, record.keys = provenance, keys
        st.trace.stages.append(record)
        st.layout, st.provenance = result.layout, result.provenance
        st.pending_relevance = st.pending_keys = None
        st.compressed = True
        self._refresh(st, hidden.dtype)
        if isinstance(output, tuple):
            return (result.hidden,) + tuple(output[1:])
        return result.hidden

    # ---------------------------------------------------------------- internals
    def _refresh(self, st: _Forward, dtype: torch.dtype) -> None:
        """Position embeddings, position ids and mask of the current (compressed) sequence."""
        origin, valid = st.layout.origin, st.layout.valid_mask
        index = origin.clamp_min(0)
        if st.full_pos is not None:
            cos, sin = st.full_pos
            st.pos = (gather_tokens(cos, index), gather_tokens(sin, index))
        st.pos_ids = gather_position_ids(st.full_pos_ids, index)
        st.mask = prefill_mask(origin, valid, st.impl, dtype)

    def _masked_layer(self, cache: Cache, i: int) -> MaskedCacheLayer:
        layers = cache.layers
        new = MaskedCacheLayer(self._token)
        if len(layers) > i:
            old = layers[i]
            if type(old) is not DynamicLayer and not isinstance(old, MaskedCacheLayer):
                raise TypeError(
                    f"lightkv supports DynamicCache full-attention layers only; cache layer {i} is "
                    f"{type(old).__name__} (static, sliding-window, quantized and offloaded caches are not supported)"
                )
            if old.get_seq_length() > 0:
                raise RuntimeError(f"cache layer {i} is not empty at prefill")
            layers[i] = new
        elif len(layers) == i and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
            layers.append(new)
        else:
            raise TypeError(f"unexpected cache structure at layer {i} ({type(cache).__name__})")
        return new

    def _relevance(
        self,
        i: int,
        stage: Stage,
        hidden: torch.Tensor,
        pos: tuple[torch.Tensor, torch.Tensor] | None,
        layout: VisionLayout,
    ) -> torch.Tensor:
        """ξ ``[B, N]`` at layer ``i`` from the layer's input, projecting only the rows and
        columns the relevance policy reads."""
        rel = stage.relevance
        rows, cols = rel.query_rows, rel.key_cols
        if rows == "none" and cols == "none":
            return rel.score(None, None, layout).float()
        probe = self._probes[i]
        b, n = layout.batch_size, layout.seq_len
        if pos is None:
            raise RuntimeError(f"layer {i} received no position_embeddings; cannot compute relevance")
        cos, sin = _batch(pos[0], b), _batch(pos[1], b)
        x = probe.normed(hidden)
        d = probe.head_dim
        flops = 0.0

        def project(fn, index: torch.Tensor, heads: int) -> torch.Tensor:
            nonlocal flops
            out = fn(gather_tokens(x, index), gather_tokens(cos, index), gather_tokens(sin, index))
            flops += 2.0 * index.numel() * probe.hidden * heads * d
            full = out.new_zeros(b, heads, n, out.shape[-1])
            return full.scatter(2, index[:, None, :, None].expand(-1, heads, -1, out.shape[-1]), out)

        all_rows = torch.arange(n, device=x.device).expand(b, n)
        if rows == "all":
            queries = project(probe.queries, all_rows, probe.heads)
        elif rows == "last":
            queries = project(probe.queries, _last_valid(layout.valid_mask).unsqueeze(1), probe.heads)
        else:
            queries = None
        if cols == "all":
            keys = project(probe.keys, all_rows, probe.kv_heads)
        elif cols == "text":
            text_pos, _ = pack_rows(layout.text_mask)
            keys = project(probe.keys, text_pos, probe.kv_heads)
        else:
            keys = None
        q_rows = n if rows == "all" else (1 if rows == "last" else 0)
        k_cols = n if cols == "all" else (int(layout.text_mask.sum(1).max()) if cols == "text" else 0)
        flops += 2.0 * b * probe.heads * d * q_rows * k_cols
        self._state.trace.relevance_flops += flops
        xi = rel.score(queries, keys, layout)
        return xi.to(torch.promote_types(xi.dtype, torch.float32))
