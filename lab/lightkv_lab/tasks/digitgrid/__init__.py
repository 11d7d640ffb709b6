"""DigitGrid-VQA: a synthetic VQA task whose answers depend on one image region.

See `lightkv_lab.tasks.digitgrid.data` for the images, questions, vocabulary and batching
(import them from there). Needs scikit-learn for the handwritten digits.
"""
