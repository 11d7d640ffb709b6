"""Fuyu (``FuyuForCausalLM``): encoder-free, our stand-in for EVE.

Image patches are projected straight into the decoder. The prompt holds the image row by
row: ``cols`` placeholder tokens (``config.image_token_id``, "|SPEAKER|") followed by one
row-newline token ("|NEWLINE|", structural: never merged), ``rows`` times. The grid is
read from ``input_ids`` alone.

The newline id is not in the model config: pass ``newline_token_id=`` to `apply`, or it
is taken from ``config.image_newline_id`` when present, or else detected as the token
that follows every run of placeholders.

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a
  padded batch, sdpa, eager and FlashAttention-2 (2-D padding masks; = the sdpa run under the test
  stand-in), images of different sizes in one batch.
Refused: nothing family-specific; beam search with images fails in transformers itself.
"""

from __future__ import annotations

from ..graph.layout import ImageSegment
from .base import Adapter, token_runs

__all__ = ["FuyuAdapter"]


class FuyuAdapter(Adapter):
    """Fuyu: a patch grid with one newline token after every row."""

    family = "fuyu"
    model_types = ("fuyu",)
    options_allowed = ("newline_token_id",)

    def newline_id(self, input_ids, runs) -> int | None:
        given = self.options.get("newline_token_id", getattr(self.config, "image_newline_id", None))
        if given is not None:
            return int(given)
        followers = {int(input_ids[r, s + n]) for r, s, n in runs if s + n < input_ids.shape[1]}
        return followers.pop() if len(followers) == 1 else None

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        runs = token_runs(input_ids == self.config.image_token_id)
        if not runs:
            return None
        ids = input_ids.cpu()
        newline = self.newline_id(ids, runs)
        n = ids.shape[1]

        def ends_row(r, s, length):
            return newline is not None and s + length < n and int(ids[r, s + length]) == newline

        segments, k = [], 0
        while k < len(runs):
            row, start, cols = runs[k]
            if not ends_row(row, start, cols):
                segments.append(ImageSegment(row=row, offset=start, grid=(1, cols)))
                k += 1
                continue
            rows = 1
            while k + rows < len(runs):
                r2, s2, c2 = runs[k + rows]
                prev_end = runs[k + rows - 1][1] + cols + 1
                if r2 != row or s2 != prev_end or c2 != cols or not ends_row(r2, s2, c2):
                    break
                rows += 1
            segments.append(
                ImageSegment(row=row, offset=start, grid=(rows, cols), newline_every=cols)
            )
            k += rows
        return self.layout_from_segments(input_ids, segments, padding)
