"""The torch_dist writer mmparity used before ``torch_dist_write``: the family's native Megatron
model built on meta supplies mcore's sharded state dict (keys, layer offsets, the swiglu
factory), and megatron-core's own save strategy plans and writes it (DCP under gloo).

Kept as the reference ``tests/io/test_torch_dist_layout.py`` compares the megatron-free writer
with: both are given the same source, and what they write must load the same.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

from mmparity.errors import ConvertError, problems_line
from mmparity.io import extra_state, megatron_args
from mmparity.io.formats.base import Output, Progress
from mmparity.io.formats.mcore import mcore_plan, mcore_provenance, side_files as mcore_side_files
from mmparity.io.fsio.errors import CheckpointError
from mmparity.io.fsio.heap import heap_budget
from mmparity.io.layout import HF_CONFIG_FILE, RELEASE
from mmparity.mapping import rules as R
from mmparity.mapping.tables import padded_tables as padded_tables_of
from mmparity.megatron import mcore_compat as mc
from mmparity.megatron.torch_dist import extra_state_objects, save_torch_dist
from mmparity.parallel import ep as ep_mod
from mmparity.parallel import pp as pp_mod
from mmparity.parallel import runtime
from mmparity.parallel.axes import Grid


def write_with_mcore(source, out: Output, progress=None) -> tuple[int, int]:
    progress = progress or Progress()
    order, kinds = mcore_plan(source, out.grid)
    # torch_dist stores global tensors: the TP/PP/EP sizes only had to fit (checked above).
    pp_mod.pipeline_layout(order).layer_counts(out.grid.pp)
    total = sum(source.metas[k].nbytes for k in order)
    rules = source.rules
    aside = set(R.side_keys(rules))
    side_files, side_records, side_extra = mcore_side_files(source)
    with runtime.parallel_context(1, 1):
        # The model only supplies mcore's sharding metadata (keys, layer offsets, the swiglu
        # factory); built on meta it costs no memory, and its data is replaced below.
        with torch.device("meta"):
            model = source.model.spec.build_native(source.cfg)
        sharded = model.sharded_state_dict()
        # The layer stacks mcore keys layer by layer (a non-homogeneous block: dense and MoE
        # layers), as its sharded tensors' keys tell; the extra states follow them.
        per_layer_stacks = {parts[0] for entry in sharded.values()
                            if isinstance(entry, (mc.ShardedTensor, ShardedTensorFactory))
                            and (parts := pp_mod.layer_key_parts(entry.key)) is not None}
        # The converter's name of every sharded entry, spelled all at once (a layer's own keys say
        # whether its norms are fused) and with expert keys in the rule table's layout (mcore's
        # SequentialMLP names its sharded entries local_experts.{e}. whatever its state dict says).
        tensors = {local: local for local, entry in sharded.items()
                   if isinstance(entry, (mc.ShardedTensor, ShardedTensorFactory))}
        spelled = R.to_te_spelling(tensors)
        if ep_mod.expert_key_layout(order):
            spelled = ep_mod.respell(spelled, ep_mod.expert_key_layout(order))
        converter_key = {local: key for key, local in spelled.items()}
        local_keys: dict[str, str] = {}
        problems = []
        for local, entry in sharded.items():
            if isinstance(entry, ShardedObject):
                continue
            if not isinstance(entry, (mc.ShardedTensor, ShardedTensorFactory)):
                problems.append(f"{local}: unsupported sharded entry {type(entry).__name__}")
                continue
            key = converter_key.get(local)
            if key in aside:  # the native model's own modules for side tensors (e.g. CLIP's ln_post)
                continue
            if key not in source.metas:
                problems.append(f"the native model's {local} has no converted tensor")
            local_keys[local] = key
        problems += [f"converted tensor {k} is not in the native model" for k in sorted(set(order) - set(local_keys.values()))]
        if problems:
            raise ConvertError(problems_line(f"{source.family!r}: the native model and the converter disagree", problems))
        progress.phase(f"{source.family} -> torch_dist", len(local_keys), total)
        padded_tables = padded_tables_of(rules)
        # Every entry gets a meta placeholder of the converted shape; DCP plans from those, and
        # each tensor is produced from the source only when the writer reaches it.
        # Keyed by the placeholder's storage, which every alias mcore makes of it shares; the
        # placeholder is kept alive so the key stays unique.
        key_of: dict[int, tuple[str, torch.Tensor]] = {}
        for local in [name for name in sharded if converter_key.get(name) in aside]:
            del sharded[local]
        # The native model's extra states are its own modules'; Megatron's class declares others
        # (its attention's, none for linears it keeps whole): written as Megatron's, empty.
        for local in [name for name, entry in sharded.items()
                      if isinstance(entry, ShardedObject) and extra_state.is_extra_state(name)]:
            del sharded[local]
        sharded.update(extra_state_objects(extra_state.sharded_extra_state_keys(
            {k: kinds[k] for k in order}), order, per_layer_stacks))
        for local, key in local_keys.items():
            entry = sharded[local]
            meta = source.metas[key]
            placeholder = torch.empty(tuple(meta.shape), dtype=meta.dtype, device="meta")
            key_of[placeholder.untyped_storage()._cdata] = (key, placeholder)
            if isinstance(entry, ShardedTensorFactory):
                sharded[local] = dataclasses.replace(entry, data=placeholder)
            else:
                if (key in padded_tables and tuple(meta.shape) != tuple(entry.local_shape)
                        and tuple(meta.shape[1:]) == tuple(entry.local_shape[1:])):
                    # The native model pads with Megatron-LM's default divisor; the table is
                    # written with the one asked for (TP 1: the shard is the whole table).
                    entry = dataclasses.replace(entry, data=placeholder, local_shape=tuple(meta.shape),
                                                global_shape=tuple(meta.shape))
                if tuple(meta.shape) != tuple(entry.local_shape):
                    raise ConvertError(f"{key}: converted shape {list(meta.shape)}, the native model expects "
                                       f"{list(entry.local_shape)}")
                sharded[local] = dataclasses.replace(entry, data=placeholder, dtype=meta.dtype)
        heap = heap_budget()

        source_errors: list = []

        def produce(target: torch.Tensor) -> tuple:
            key, placeholder = key_of.get(target.untyped_storage()._cdata, (None, None))
            try:
                if key is None:
                    raise ConvertError(f"internal: a torch_dist shard of shape {list(target.shape)} has no source tensor")
                pieces = source.mcore_pieces(key)
            except ConvertError as exc:
                source_errors.append(exc)  # DCP wraps it in a multi-line report; ours is the one line
                raise
            nbytes = sum(p.numel() * p.element_size() for p in pieces)
            progress.advance(0, nbytes)
            heap.check(nbytes)
            return placeholder, pieces

        del model
    # The sharded state dict is complete: mcore's groups are freed (in the background) while the
    # write runs under the default group alone.
    with runtime.process_group():
        try:
            save_torch_dist(out.dst, sharded, provenance=mcore_provenance(source, out, **side_extra),
                            extra_records=side_records, grid=Grid.of(),
                            extra_files={HF_CONFIG_FILE: source.config_bytes, **side_files},
                            force=out.force, produce=produce, locate=source.locate,
                            iteration=RELEASE if out.release else 1,
                            common={megatron_args.ARGS_KEY: megatron_args.checkpoint_args(
                                source.cfg, {k: source.metas[k].shape for k in order}, ckpt_format="torch_dist",
                                grid=out.grid, vocab_multiple=source.vocab_multiple,
                                declared=getattr(source.model, "recorded_args", None))},
                            content_metadata=megatron_args.content_metadata())
        except CheckpointError as exc:
            raise (source_errors[0] if source_errors else ConvertError(str(exc))) from None
    progress.advance(len(local_keys), 0)
    return len(local_keys), total
