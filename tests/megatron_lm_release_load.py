"""Megatron-LM main's own ``load_checkpoint`` of a ``convert --release`` checkpoint with a plain
``--load`` (no --finetune / --no-load-optim / --no-load-rng), on CPU, one rank: run by
``tests/io/test_release.py`` as ``python tests/megatron_lm_release_load.py DIR FORMAT HF_DIR PORT``
with Megatron-LM main on PYTHONPATH. Prints one JSON line: the iteration it loaded at, how many
tensors, how many the load changed, and which differ from ``live.import_hf`` of the release.
The one CPU workaround is here in the harness, never in mmparity."""
import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
from megatron.training import checkpointing as ckpt, global_vars
from megatron.training.arguments import parse_args
from mmparity.parallel import runtime
from mmparity.megatron import live
from mmparity.models import registry as families
from mmparity.models.core import megatron_classes as models

dst, fmt, hf = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = live.family_config(hf, "llava")
text = cfg.text_config
sys.argv = ["pretrain", "--num-layers", str(text.num_hidden_layers), "--hidden-size", str(text.hidden_size),
            "--num-attention-heads", str(text.num_attention_heads), "--load", dst, "--ckpt-format", fmt,
            "--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "16",
            "--max-position-embeddings", str(text.max_position_embeddings)]
args = parse_args()
args.use_dist_ckpt = args.ckpt_format != "torch"
args.world_size, args.data_parallel_size = 1, 1
global_vars.set_args(args)
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
init_num_microbatches_calculator(0, None, 1, 1, 1)
runtime.init_parallel(1, 1)
# CPU workaround (harness only): read_metadata all-reduces the iteration through a CUDA tensor.
_orig = ckpt.read_metadata
def read_metadata(tracker):
    real = torch.distributed.is_initialized
    torch.distributed.is_initialized = lambda: False
    try:
        return _orig(tracker)
    finally:
        torch.distributed.is_initialized = real
ckpt.read_metadata = read_metadata
model = models.build(families.get("llava").megatron_class()[1].build, cfg)
before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
iteration, flops = ckpt.load_checkpoint([model], None, None)
# The loaded weights are what mmparity's own import gives for the release.
fresh = models.build(families.get("llava").megatron_class()[1].build, cfg)
live.import_hf(fresh, hf, "llava")
a = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
b = {k: v for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
bad = [k for k in a if not torch.equal(a[k], b[k])]
changed = sum(not torch.equal(before[k], a[k]) for k in a)
print(json.dumps({"iteration": iteration, "tensors": len(a), "changed": changed, "differ": bad}))
runtime.teardown_parallel()
