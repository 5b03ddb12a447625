"""The disk layer: checkpoint formats (HF safetensors directories, Megatron-LM's legacy and
torch_dist layouts), the manifest every writer leaves beside them, and the file system work under
them (``fsio``).

It knows tensors and names, never a model: a reader is handed the rule set and the config of what
it reads (built once per conversion by ``mmparity.convert``), a writer a narrow record of what to
write. Each format is one module of :mod:`mmparity.io.formats`; ``verify(dir)``
(:mod:`mmparity.io.verify`) re-checks a written checkpoint against its ``mmparity.json``. Nothing
here imports transformers or megatron (Megatron's own torch_dist save and load are
``mmparity.megatron.torch_dist``'s).
"""
