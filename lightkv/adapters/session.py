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
* a forward pre-hook on every decoder layer and a forward hook on the layers a mode
  works after: each wraps the call in a `LayerCall` and hands it to the session's modes
  (`lightkv.adapters.modes`), which do the work. The session itself never branches on
  what the pipeline does: the schedule chose the modes when the session started.

The modes: ``sequence`` (always) hands every layer after a compression hidden states,
position embeddings (1-D RoPE or Qwen's 3-D M-RoPE), position ids and a 4-D attention
mask that describe the *shorter* sequence, gives its cache a `MaskedCacheLayer` that
remembers the holes, and during decoding a mask built from that cache; ``layer`` runs the
pure `lightkv.Stage` on a scheduled layer's output, with relevance ξ read from the layer's
own q / k projections as it runs (`ProjectionTap`, never an ``N x N`` matrix);
``pre_llm`` runs a stage before layer 0; ``cache`` and ``h2o`` leave hidden states alone and
replace listed layers' cache entries after they ran; ``tower`` reads the vision tower's
attention. Beam search works because the hole masks live in the cache layers and follow
``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``;
``proportional`` adds ``log(size)`` per key (on the mask, or through the bias
channel or FlexAttention on kernels without a mask argument: `lightkv.adapters.bias`);
``released`` reproduces the released code's
renumbered positions, unmasked first merge and eager merge layers.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..graph.layout import VisionLayout
from ..pipeline import Pipeline
from ..policies.prompt import Prompt
from . import proportional
from .base import Adapter, bind_arguments
from .cache import _Token
from .guards import (
    attention_implementation,
    check_attention_mask,
    check_cache,
    check_flash,
    refuse_compiled,
)
from .modes import LayerCall, Mode, SessionContext, choose_modes
from .ownership import ACTIVE, CallOwner, cache_of
from .probes import LayerShape, probe_for_layer
from .registry import get_adapter
from .released import ReleasedQuirksHook
from .report import SessionReport
from .tap import ProjectionTap
from .trace import ForwardState, PrefillTrace, StageRecord

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
        proportional_route: how `lightkv.Pipeline.proportional_attention` reaches the
            logits (`lightkv.adapters.bias`): ``auto`` (the mask under eager and sdpa, the
            bias channel under FlashAttention-2, FlexAttention under flex_attention),
            ``mask``, ``channel`` or ``flex``. Every route is exact; unused without the
            option.
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
        proportional_route: str = "auto",
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
        # the pipeline's layout picks the adapter method once; the adapter holds no session state
        self._build_layout = (
            self.adapter.reference_layout
            if pipeline.layout == "reference"
            else self.adapter.build_layout
        )
        self.model = model
        self.record = record
        self._mm = self.adapter.multimodal_module()
        self._lm = self.adapter.language_model()
        self.layers = list(self.adapter.decoder_layers())
        refuse_compiled(model, [self._mm, self._lm, *self.layers])
        self.num_layers = len(self.layers)
        self.stages = pipeline.stages(self.num_layers)
        self.adapter.check_stages(self.stages)
        self._token = _Token()
        self._token.open = False
        probes = [probe_for_layer(layer) for layer in self.layers]
        self.layer_shapes: list[LayerShape] = [p.shape() for p in probes]
        self._ctx = SessionContext(
            self.adapter,
            pipeline,
            self.stages,
            self.num_layers,
            probes,
            proportional.ProportionalAttention(
                self.adapter,
                pipeline.proportional_attention,
                proportional_route,
                [getattr(layer, "self_attn", None) for layer in self.layers],
                attention_implementation(self._lm.config),
            ),
            ReleasedQuirksHook(self.adapter, pipeline.released_quirks, self._lm, self.stages),
            record=record,
            reuse_projections=reuse_projections,
            token=self._token,
        )
        self.modes: list[Mode] = choose_modes(self._ctx)
        """The session's modes (`lightkv.adapters.modes`), in the order they run."""
        self._pre, self._post = self._hook_table("pre"), self._hook_table("post")
        self._rewritten = sorted(set().union(*(m.cache_layers for m in self.modes)))
        self._text_too = any(m.text_too for m in self.modes)
        self._signature = inspect.signature(self._mm.forward)
        # fail early on unsupported attention, and on what FlashAttention-2 cannot compute
        impl = self._attn_impl()
        check_flash(
            impl, self.adapter, [getattr(layer, "self_attn", None) for layer in self.layers]
        )
        if impl == "flex_attention" and pipeline.released_quirks.any:
            raise NotImplementedError(
                "the released code's quirks hand their merge layers masks for transformers' own "
                "kernels, which lightkv does not route under flex_attention; load the model with "
                "attn_implementation='sdpa' or 'flash_attention_2'"
            )
        route = self._ctx.proportional.route(impl)
        if pipeline.proportional_attention and route != "mask" and self._ctx.released.eager_layers:
            raise NotImplementedError(
                f"released_quirks eager_merge_layers run merge layers eagerly (the mask route) "
                f"while proportional attention takes the {route} route under {impl}: a merge "
                "layer's cache would hold its entries without the bias its decoding needs; turn "
                "the quirk off or load the model with attn_implementation='sdpa'"
            )
        self._handles: list[Any] = []
        self._owner = False
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
                "a lightkv compression session is already active on this "
                f"{type(self.model).__name__}; exit it before applying another pipeline"
            )
        try:
            self._handles.append(
                self._mm.register_forward_pre_hook(self._on_model_pre, with_kwargs=True)
            )
            self._handles.append(
                self._mm.register_forward_hook(
                    self._on_model_post, with_kwargs=True, always_call=True
                )
            )
            for i, layer in enumerate(self.layers):
                self._handles.append(
                    layer.register_forward_pre_hook(
                        functools.partial(self._on_layer_pre, i), with_kwargs=True
                    )
                )
                if self._post["prefill"][i] or self._post["decode"][i]:
                    self._handles.append(
                        layer.register_forward_hook(
                            functools.partial(self._on_layer_post, i), with_kwargs=True
                        )
                    )
            for mode in self.modes:
                self._handles.extend(mode.install())
        except BaseException:
            self._remove()
            raise
        self._token = self._ctx.token = _Token()
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

    _state = property(
        lambda self: self._calls.state, lambda self, v: setattr(self._calls, "state", v)
    )

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
        return dict(getattr(self._ctx.modes.get("layer"), "taps", {}))

    def report(self) -> SessionReport:
        """A `lightkv.adapters.report.SessionReport` of the last prefill."""
        return SessionReport.from_session(self)

    # ---------------------------------------------------------------- helpers
    def _attn_impl(self) -> str:
        return attention_implementation(self._lm.config)

    def _hook_table(self, when: str) -> dict[str, list[list]]:
        """Per phase (``prefill``, ``decode``) and layer, the modes' ``{phase}_{when}`` methods
        the hooks call, in mode order: fixed once, so that the hooks only call them."""
        return {
            phase: [
                [h for m in self.modes if m.covers(i) and (h := m.hook(phase, when)) is not None]
                for i in range(self.num_layers)
            ]
            for phase in ("prefill", "decode")
        }

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
        check_cache(cache, self.adapter.cache_layer_types, self._rewritten)
        past = cache.get_seq_length() if cache is not None else 0
        mask2d = inputs.get("attention_mask")
        check_attention_mask(mask2d)
        new_valid = (
            mask2d[:, -q:].bool()
            if mask2d is not None
            else torch.ones(b, q, dtype=torch.bool, device=ref.device)
        )
        self.num_forwards += 1
        if past > 0:
            self._state = ForwardState(phase="decode", impl=impl, new_valid=new_valid, past=past)
            return
        layout = None
        if input_ids is not None:
            padding = ~new_valid if mask2d is not None and not bool(new_valid.all()) else None
            layout = self._build_layout(inputs, padding)
        elif any(inputs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
            raise ValueError(
                "lightkv needs input_ids to find the vision tokens; call the model with "
                "input_ids, not inputs_embeds"
            )
        if layout is not None and not bool(layout.vision_mask.any()):
            layout = None
        if (
            layout is None and input_ids is not None and self._text_too
        ):  # a mode that works on text alone (H2O)
            padding = ~new_valid if not bool(new_valid.all()) else None
            layout = VisionLayout.from_segments(b, q, [], padding_mask=padding, device=ref.device)
        trace = PrefillTrace(batch_size=b, input_len=q, layout=layout, input_valid=new_valid)
        self._state = ForwardState(
            phase="prefill",
            impl=impl,
            layout=layout,
            new_valid=new_valid,
            trace=trace,
            prompt=Prompt(input_ids) if input_ids is not None else None,
        )
        self.num_prefills += 1
        return

    def _on_model_post(self, module, args, kwargs, output):
        st = self._state
        self._state = None
        for mode in self.modes:
            mode.end_forward()
        if st is not None and st.trace is not None:
            st.trace.final_layout = st.layout
            st.trace.provenance = st.provenance
            self.last_prefill = st.trace

    # ---------------------------------------------------------------- layer hooks
    def _on_layer_pre(self, i: int, module, args, kwargs):
        st = self._state
        if st is None:
            return None
        call = LayerCall(i, args, kwargs, st)
        for hook in self._pre[st.phase][i]:
            hook(call)
        return call.args, call.kwargs

    def _on_layer_post(self, i: int, module, args, kwargs, output):
        st = self._state
        if st is None:
            return None
        call = LayerCall(i, args, kwargs, st, output)
        for hook in self._post[st.phase][i]:
            hook(call)
        return call.post_result()
