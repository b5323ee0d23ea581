"""Compile-only: every accelerator program of cfir-jax compiled for a TPU topology that is not attached.

MaxText's `train_compile.py` pattern: the devices of a TPU topology come from libtpu's description
(`topology.resolve`), the programs are the project's own jitted functions with abstract arguments that carry their
shardings (`programs`), and `compile.compile_program` runs the real TPU compiler and SPMD partitioner and reads each
chip's memory from the compiled executable. Nothing is allocated and no data is read, so a 64-chip job is checked
on a laptop before anyone pays for it. What this proves and what it does not: see README, "Compiled for TPUs".
"""
