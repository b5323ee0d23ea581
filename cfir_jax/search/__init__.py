"""The search layer: scoring image rows against queries, below both the index builder and retrieval.

Exact top-k, once (`topk`: over a candidate set in numpy, over the whole cache in jitted blocks); the compact int8
copy of the cache and the CPU two-pass SR scorer (`compact`, `cpu_sr`); the cache resident on the JAX devices with
its jitted SR and full search (`device_sr`); the fused [image, image text] view that lets every scorer serve fusion
(`fused`); ScaNN's approximate search for the entity index (`knn`). It reads arrays and the stores only: nothing here
imports a stage (index, train, retrieve).
"""
