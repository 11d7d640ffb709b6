"""The compression session: compress vision tokens inside the prefill of an unmodified
``transformers`` vision-language model.

Internals (an adapter author reads `lightkv.adapters.base` instead): the hooks, built on
``cache`` (holes), ``masks``, ``features`` (relevance, keys) and ``guards`` (refusals).

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
  scheduled layer the `ProjectionTap` reads the layer's own q / k projections as it runs
  and computes prompt relevance ξ from the rows and columns the relevance policy reads
  (never an ``N x N`` matrix);
* a forward hook on every scheduled layer: runs the pure `lightkv.Stage` on the layer's
  output and returns the stage's shorter hidden states in its place.

During decoding each compressed layer gets a mask built from its own cache (holes hidden);
positions come from the model as usual (the original prompt length onwards), so every
layer continues consistently. Beam search works because the hole masks live in the cache
layers and follow ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``.
The cache mode (``cache_mode``: cache stages, H2O) leaves hidden states alone and replaces
listed layers' cache entries after they ran; ``proportional`` adds ``log(size)`` per key;
``released`` reproduces the released code's renumbered positions and unmasked first merge.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..graph.layout import TokenKind, VisionLayout
from ..pipeline import Pipeline, Stage
from ..policies.prompt import Prompt
from . import features, proportional
from .base import Adapter, bind_arguments
from .cache import MaskedCacheLayer, _Token, install_masked_layer
from .cache_mode import CacheMode
from .guards import attention_implementation, check_attention_mask, check_cache, refuse_compiled
from .masks import drop_padding, gather_position_ids, gather_tokens
from .ownership import ACTIVE, CallOwner, cache_of
from .probes import AttentionProbe, LayerShape, probe_for_layer
from .registry import get_adapter
from .released import ReleasedQuirksHook
from .report import SessionReport
from .tap import ProjectionTap
from .tower import TowerTap
from .trace import ForwardState, LayerStat, PrefillTrace, StageRecord

__all__ = ["CompressionSession"]

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
        reuse_projections: compute relevance (and stage keys) from the scheduled layer's own
            query / key projections as the layer runs (`lightkv.adapters.tap`); False
            projects the layer's input a second time (the slower path, for comparisons).
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
        reuse_projections: bool = True,
        **adapter_options: Any,
    ):
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"expected a lightkv.Pipeline, got {type(pipeline).__name__}")
        refuse_compiled(model)
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
        refuse_compiled(model, [self._mm, self._lm, *self.layers])
        self.num_layers = len(self.layers)
        self.stages = pipeline.stages(self.num_layers)
        self.adapter.check_stages(self.stages)
        self._stage_at = {s.spec.layer: s for s in self.stages if not s.spec.before and not s.spec.cache}
        self._before_at = {s.spec.layer: s for s in self.stages if s.spec.before}  # the pre-LLM mode
        self._probes: list[AttentionProbe] = [probe_for_layer(layer) for layer in self.layers]
        self.layer_shapes: list[LayerShape] = [p.shape() for p in self._probes]
        self._taps = {i: ProjectionTap(self._probes[i], i) for i, s in self._stage_at.items()
                      if reuse_projections and ProjectionTap.wanted(s)}
        self._tower = TowerTap.for_stages(self.adapter, self.stages)  # VisionZip-style tower relevance
        self._cache_mode = CacheMode(self, self.stages)  # cache stages and H2O (no-op without them)
        self._prop = proportional.ProportionalAttention(self.adapter, pipeline.proportional_attention)
        self._released = ReleasedQuirksHook(self.adapter, pipeline.released_quirks, self._lm, self.stages)
        self._signature = inspect.signature(self._mm.forward)
        self._attn_impl()  # fail early on unsupported attention
        self._handles: list[Any] = []
        self._owner = False
        self._token = _Token()
        self._token.open = False
        self._calls = CallOwner()  # the thread whose calls are compressed, and its forward's state
        self.last_prefill: PrefillTrace | None = None
        self.num_prefills = 0
        self.num_forwards = 0

    # ---------------------------------------------------------------- context manager
    @property
    def active(self) -> bool:
        """True inside the ``with`` block."""
        return bool(self._handles)

    def __enter__(self) -> CompressionSession:
        if self._lm in ACTIVE:
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
                if i in self._stage_at or i in self._cache_mode.layers:
                    self._handles.append(
                        layer.register_forward_hook(functools.partial(self._on_layer_post, i), with_kwargs=True)
                    )
            for tap in [*self._taps.values(), *([self._tower] if self._tower else [])]:
                self._handles.extend(tap.install())
        except BaseException:
            self._remove()
            raise
        self._token = _Token()
        self._calls.claim()
        ACTIVE.add(self._lm)
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
        self._calls.release()
        if self._owner:
            ACTIVE.discard(self._lm)
            self._owner = False

    _state = property(lambda self: self._calls.state, lambda self, v: setattr(self._calls, "state", v))

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) inside the block copies the hooks and, through them, this session:
        # the copy owns no calls, so the copied model's hooks do nothing
        clone = memo[id(self)] = copy.copy(self)
        clone._calls = CallOwner()
        return clone

    # ---------------------------------------------------------------- results
    @property
    def records(self) -> list[StageRecord]:
        """The stages of the last prefill."""
        return list(self.last_prefill.stages) if self.last_prefill else []

    def to_prompt_positions(self, t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Put a per-token output of the last prefill (``[B, N', ...]``, e.g. ``logits``)
        back at the prompt positions its tokens came from: ``[B, N0, ...]``, ``fill`` where
        a prompt token no longer has its own column (merged, dropped or padding)."""
        if self.last_prefill is None:
            raise RuntimeError("no prefill has run in this session")
        return self.last_prefill.to_prompt_positions(t, fill)

    @property
    def taps(self) -> dict[int, ProjectionTap]:
        """The projection taps by scheduled layer (empty with ``reuse_projections=False``)."""
        return dict(self._taps)

    def report(self) -> SessionReport:
        """A `lightkv.adapters.report.SessionReport` of the last prefill."""
        return SessionReport.from_session(self)

    # ---------------------------------------------------------------- helpers
    def _attn_impl(self) -> str:
        return attention_implementation(self._lm.config)

    # ---------------------------------------------------------------- model hooks
    def _on_model_pre(self, module, args, kwargs):
        if not self._calls.admits(self.model):
            return
        self._state = None
        inputs = bind_arguments(self._signature, args, kwargs)
        input_ids = inputs.get("input_ids")
        embeds = inputs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        if ref is None:
            return
        b, q = ref.shape[:2]
        impl = self._attn_impl()
        cache = cache_of(inputs)
        # before the mask check: with a static cache transformers prepares a 4-D mask
        check_cache(cache, self.adapter.cache_layer_types, self._cache_mode.layers)
        past = cache.get_seq_length() if cache is not None else 0
        mask2d = inputs.get("attention_mask")
        check_attention_mask(mask2d)
        new_valid = (
            mask2d[:, -q:].bool() if mask2d is not None else torch.ones(b, q, dtype=torch.bool, device=ref.device)
        )
        self.num_forwards += 1
        if past > 0:
            self._state = ForwardState(mode="decode", impl=impl, new_valid=new_valid, past=past)
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
        if layout is None and input_ids is not None and self._cache_mode.text_too:  # H2O on every token
            padding = ~new_valid if not bool(new_valid.all()) else None
            layout = VisionLayout.from_segments(b, q, [], padding_mask=padding, device=ref.device)
        trace = PrefillTrace(batch_size=b, input_len=q, layout=layout, input_valid=new_valid)
        self._state = ForwardState(mode="prefill", impl=impl, layout=layout, new_valid=new_valid, trace=trace,
                                   prompt=Prompt(input_ids) if input_ids is not None else None)
        self.num_prefills += 1
        return

    def _on_model_post(self, module, args, kwargs, output):
        st = self._state
        self._state = None
        if self._tower is not None:  # generate runs the tower before this forward: forget it only now
            self._tower.clear()
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
        cache = cache_of(kwargs)
        if st.mode == "decode":
            if cache is None or len(cache.layers) <= i or not isinstance(cache.layers[i], MaskedCacheLayer):
                return None
            layer_cache = cache.layers[i]
            if layer_cache.valid is None:
                return None
            dev = layer_cache.valid.device
            q = hidden.shape[1]
            valid = torch.cat([layer_cache.valid, st.new_valid.to(dev)], dim=1)
            new_origin = (st.past + torch.arange(q, device=dev)).expand(valid.shape[0], q)
            origin = torch.cat([layer_cache.origin, new_origin], dim=1) if layer_cache.origin is not None else None
            kwargs["attention_mask"] = self._prop.decode_mask(i, origin, valid, q, st.impl, hidden.dtype, layer_cache)
            self._cache_mode.decode_pre(i, st, hidden, kwargs, layer_cache)
            layer_cache.pending = st.new_valid
            layer_cache.pending_origin = new_origin
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
        before = self._before_at.get(i)
        if before is not None:  # compress the layer's input: every layer caches the shorter sequence
            st.full_pos, st.full_pos_ids = kwargs.get("position_embeddings"), kwargs.get("position_ids")
            self._prepare(i, before, hidden, st.full_pos, layout)
            hidden = self._compress(i, before, hidden)
            if args:
                args = (hidden, *args[1:])
            else:
                kwargs["hidden_states"] = hidden
            layout = st.layout
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
            unmasked = self._released.prefill_mask(i, layout, st.impl, hidden.dtype)  # released code's first merge
            if unmasked is not None:
                kwargs["attention_mask"] = unmasked
        else:
            key = self.adapter.mask_key(i)
            if key not in st.masks:
                st.masks[key] = self._prop.prefill_mask(i, layout, st.provenance, st.impl, hidden.dtype)
            kwargs["attention_mask"] = st.masks[key]
            full = kwargs.get("position_embeddings")
            if full is not None and full is not st.full_pos and isinstance(full, tuple):
                # this layer has its own position embeddings (Gemma 3: local and global RoPE)
                if id(full) not in st.gathered:
                    index = layout.origin.clamp_min(0)
                    st.gathered[id(full)] = (full, tuple(gather_tokens(t, index) for t in full))
                kwargs["position_embeddings"] = st.gathered[id(full)][1]
            elif st.pos is not None:
                kwargs["position_embeddings"] = st.pos
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = st.pos_ids
            if cache is not None:
                masked = install_masked_layer(cache, i, self._token, self.adapter.cache_layer_types)
                masked.pending, masked.pending_origin = layout.valid_mask, layout.origin
                masked.pending_columns = st.provenance.owner.shape[1]  # the original prompt width
                masked.pending_sizes = self._prop.sizes(st.provenance)  # None unless proportional attention
        stage = self._stage_at.get(i)
        if stage is not None and i in self._taps:
            self._taps[i].arm(stage, kwargs.get("position_embeddings"), layout, st.prompt)
        elif stage is not None:
            self._prepare(i, stage, hidden, kwargs.get("position_embeddings"), layout)
        self._cache_mode.prefill_pre(i, st, hidden, kwargs, cache)
        return args, kwargs

    def _prepare(self, i: int, stage: Stage, hidden, position_embeddings, layout) -> None:
        """Relevance (and keys, when a policy needs them) from layer ``i``'s own projections
        of its input, for the stage that runs next."""
        st = self._state
        with torch.no_grad():
            probe = self._probes[i]
            tower = self._tower.per_token(layout) if stage.relevance.reads_tower else None
            st.pending_relevance, flops = features.relevance(probe, stage, hidden, position_embeddings, layout, i,
                                                                prompt=st.prompt, tower=tower)
            st.pending_keys, key_flops = features.stage_keys(probe, hidden) if "keys" in stage.needs else (None, 0.0)
            st.trace.relevance_flops += flops + key_flops

    def _compress(self, i: int, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        """Run ``stage`` on ``hidden``; the session continues with the shorter sequence."""
        st = self._state
        layout, provenance = st.layout, st.provenance
        relevance, keys = st.pending_relevance, st.pending_keys
        result = drop_padding(stage(hidden, layout, relevance, provenance, keys, st.prompt))
        record = StageRecord(layer=i, stage=stage, result=result, tapped=st.pending_tapped)
        if self.record:
            record.hidden, record.layout, record.relevance = hidden, layout, relevance
            record.provenance, record.keys = provenance, keys
        st.trace.stages.append(record)
        st.layout, st.provenance = result.layout, result.provenance
        st.pending_relevance = st.pending_keys = None
        st.pending_tapped = False
        st.compressed = True
        self._refresh(st, hidden.dtype)
        return result.hidden

    def _on_layer_post(self, i: int, module, args, kwargs, output):
        st = self._state
        if st is not None and i in self._cache_mode.layers:
            cache = cache_of(kwargs)
            if st.mode == "decode":
                if cache is not None and len(cache.layers) > i:
                    self._cache_mode.decode_post(i, cache.layers[i])
            elif st.layout is not None:
                self._cache_mode.prefill_post(i, st, kwargs, cache)
            if i not in self._stage_at:
                return None
        tapped = self._taps[i].take() if i in self._taps else None
        if st is None or st.mode != "prefill" or st.layout is None:
            return None
        if tapped is not None:
            st.pending_relevance, st.pending_keys, st.pending_tapped = tapped.relevance, tapped.keys, True
            st.trace.relevance_flops += tapped.flops
        elif i in self._taps:  # the projections did not run as the tap expected: project the input
            hidden_in = args[0] if args else kwargs.get("hidden_states")
            self._prepare(i, self._stage_at[i], hidden_in, kwargs.get("position_embeddings"), st.layout)
        hidden = self._compress(i, self._stage_at[i], output[0] if isinstance(output, tuple) else output)
        if isinstance(output, tuple):
            return (hidden,) + tuple(output[1:])
        return hidden

    # ---------------------------------------------------------------- internals
    def _refresh(self, st: ForwardState, dtype: torch.dtype) -> None:
        """Position embeddings, position ids and mask of the current (compressed) sequence."""
        index = st.layout.origin.clamp_min(0)
        if st.full_pos is not None:
            cos, sin = st.full_pos
            st.pos = (gather_tokens(cos, index), gather_tokens(sin, index))
        st.pos_ids = gather_position_ids(st.full_pos_ids, index)
        # the released code's plain 0..N'-1 after a merge (a no-op unless asked for)
        st.pos, st.pos_ids = self._released.positions(st.layout, st.trace.input_valid, st.full_pos, st.pos, st.pos_ids)
        st.masks, st.gathered = {}, {}
