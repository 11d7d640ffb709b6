"""The benchmarks put a preset's tower layers at the same relative depth of a bundled model's
shallower tower (`lightkv_lab.tasks.towers.fit_tower`)."""

from __future__ import annotations

from lightkv_lab.tasks.towers import fit_tower

import lightkv


def test_vscan_local_layer_scales_from_clip_vit_l_and_others_stay():
    vscan = lightkv.load("vscan")
    assert vscan.partitioner.local_layer == 5
    assert [fit_tower(vscan, d).partitioner.local_layer for d in (1, 3, 12, 24, 48)] == [
        0,
        1,
        2,
        5,
        10,
    ]
    for name in ("divprune", "visionzip", "lightkv"):
        assert fit_tower(lightkv.load(name), 3) == lightkv.load(name)
