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

from mmparity.io import formats
from mmparity.io.formats import hf as _hf_format
from mmparity.io.formats import legacy as _legacy_format
from mmparity.io.formats import torch_dist as _torch_dist_format

formats.register(_hf_format.FORMAT, _legacy_format.FORMAT, _torch_dist_format.FORMAT)
