"""Demos: ``lightkv demo`` (`bundled`: a bundled model answers with and without LightKV, then
against the other methods). They sit above the benchmarks, whose method set-ups and
pictures they show; ``lightkv stages-demo`` (`lightkv_lab.stages_demo`, the pure core on one
image) is in the same layer.
"""
