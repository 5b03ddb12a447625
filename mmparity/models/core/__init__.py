"""Shared Megatron-Core building blocks of the native models: attention, layer specs, RoPE, the
vision transformer, mergers and pipeline-stage plumbing. Family modules in :mod:`mmparity.native`
assemble these; nothing here knows a family."""
