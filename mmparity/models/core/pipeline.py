"""Forward-only pipeline parallelism for the parity harness: one microbatch, stage after stage.

Every rank runs the same family ``run(model, case)``; what differs is what its model holds (the
stage's layers, pre-process modules on the first stage, post-process modules on the last). A
:class:`StageLink` joins the stages the way mcore's schedules do for a forward pass: before the
stage's pipelined module runs, the previous stage's activations are received and handed to the
model with ``set_input_tensor``; after it ran, its output is sent on. Every stage calls the
pipelined module the same number of times in the same order (they run the same code on the same
case), so the k-th send of one stage meets the k-th receive of the next.

Each message is a fixed-size header (dtype, rank, shape) followed by the tensor, so no stage
has to predict the shapes another produces (mcore's ``variable_seq_lengths`` does the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_HEADER_SLOTS = 8  # dtype code, number of dims, up to six dims
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _first_tensor(output):
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


class StageLink:
    """Hooks that move activations between this stage and its neighbours (use as a context).

    ``model.pipelined_module()`` (or ``module``, for a class of Megatron's own that names none)
    is the module whose input comes from the previous stage (through ``model.set_input_tensor``)
    and whose output is the next stage's input: the transformer block of a vision tower, the whole
    ``GPTModel`` of LLaVA (it sizes its RoPE table from the received tensor before its block runs).
    """

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module | None = None):
        from megatron.core import parallel_state

        self.model = model
        self.module = module if module is not None else model.pipelined_module()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.prev_rank = None if self.first else parallel_state.get_pipeline_model_parallel_prev_rank()
        self.next_rank = None if self.last else parallel_state.get_pipeline_model_parallel_next_rank()
        self._handles: list = []
        self.received = self.sent = 0

    def __enter__(self) -> "StageLink":
        if not self.first:
            self._handles.append(self.module.register_forward_pre_hook(self._receive))
        if not self.last:
            self._handles.append(self.module.register_forward_hook(self._send))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self.first:
            self.model.set_input_tensor(None)  # no stale activations for a later caller

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _receive(self, module, args):
        header = torch.empty(_HEADER_SLOTS, dtype=torch.int64, device=self._device())
        dist.recv(header, src=self.prev_rank, group=self.group)
        dtype_code, ndim = int(header[0]), int(header[1])
        shape = [int(d) for d in header[2:2 + ndim]]
        hidden = torch.empty(shape, dtype=_DTYPES[dtype_code], device=header.device)
        dist.recv(hidden, src=self.prev_rank, group=self.group)
        self.model.set_input_tensor(hidden)
        self.received += 1

    def _send(self, module, args, output):
        hidden = _first_tensor(output)
        if not torch.is_tensor(hidden):
            raise TypeError(f"{type(module).__name__} returned {type(hidden).__name__} on a "
                            "non-last pipeline stage; expected the activations to send on")
        if hidden.dim() > _HEADER_SLOTS - 2 or hidden.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {hidden.dim()}-d {hidden.dtype} tensor between stages")
        hidden = hidden.detach().contiguous()
        header = torch.zeros(_HEADER_SLOTS, dtype=torch.int64, device=hidden.device)
        header[0], header[1] = _DTYPES.index(hidden.dtype), hidden.dim()
        header[2:2 + hidden.dim()] = torch.tensor(hidden.shape, dtype=torch.int64)
        dist.send(header, dst=self.next_rank, group=self.group)
        dist.send(hidden, dst=self.next_rank, group=self.group)
        self.sent += 1


def gather_stage_results(result):
    """Every rank's ``result`` -> ``[(pp_rank, tp_rank, result), ...]`` on every rank.

    All ranks get the list, so that under ``torchrun`` each can build the same report.
    """
    from megatron.core import parallel_state

    mine = (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(), result)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
