"""Files in and out, one module per concern; callers import from the module that holds a name.

Pure torch + safetensors (no megatron, no transformers): everything here works on names, dtypes,
shapes and bytes. Bottom to top:

* `errors`: `CheckpointError`, and how its one-line messages list names;
* `bounded`: what a decode of checkpoint bytes may hand on (paths and depth a walk of it meets);
* `faults`: fault points a test can make a writer die or stop at (`MMPARITY_FAULT`);
* `paths`: what a checkpoint may name (regular files, inside itself; no link as a destination);
* `dtypes`: dtype names, and which dtypes a conversion accepts for what it reads;
* `shared`: one object per distinct tensor name and shape across a conversion's records;
* `checksums`: per-tensor digests, whole or piece by piece;
* `syscalls`: the OS calls (page population, writeback, positioned writes, in-kernel copies,
  fsync), each with its fallback;
* `heap`: glibc's free heap kept under a budget while tensors stream through;
* `pieces`: tensors as views of file mappings, cut and routed without copies;
* `slots`: writing into files laid out in advance, hashed as it goes;
* `sources`: sources watched while a conversion reads them;
* `interrupts`: steps a Ctrl-C must not split (a staging directory made and recorded, removed);
* `publish`: staging directories and the crash-safe publish;
* `safetensors_format`, `safetensors_read`, `safetensors_write`: HF's safetensors directories.

Writing never leaves a half-written checkpoint where a finished one is expected: callers write into
`publish.atomic_directory(...)`, which only moves the result into place after everything succeeded
and was fsynced.
"""
