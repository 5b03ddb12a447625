"""qwen3_5_lm on mcore: the ``qwen3_5_text`` part's ``GPTModel``, with a forward that takes token
ids. Its state dict is ``GPTModel``'s own, at the root (as the converter writes it and Megatron-LM's
``pretrain_gpt.py`` holds it); the module is kept as ``language_model`` for the parity pairs."""

from __future__ import annotations

import torch

from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import build_stage


class Qwen35LanguageModel(torch.nn.Module):
    def __init__(self, language_model, vocab_size: int):
        super().__init__()
        self.language_model = language_model
        self.config = language_model.config
        self.vocab_size = vocab_size
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self._register_state_dict_hook(_at_root)
        self.register_load_state_dict_pre_hook(_under_language_model)

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """mcore's dist-checkpoint view of the model: GPTModel's own."""
        return self.language_model.sharded_state_dict(prefix, sharded_offsets, metadata)

    def pipelined_module(self) -> torch.nn.Module:
        return self.language_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` over the real vocabulary (gathered over TP), or on a stage
        before the last the hidden states it hands on."""
        with host_placement(input_ids.device):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            out = self.language_model(input_ids, positions, None, runtime_gather_output=True)
        return out[..., :self.vocab_size] if self.post_process else out


_ROOT = "language_model."


def _at_root(module, state_dict, prefix, local_metadata):
    """State-dict hook: ``GPTModel``'s keys without the wrapper's ``language_model.``."""
    for key in [k for k in state_dict if k.startswith(prefix + _ROOT)]:
        state_dict[prefix + key[len(prefix + _ROOT):]] = state_dict.pop(key)
    return state_dict


def _under_language_model(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Load pre-hook: the root keys :func:`_at_root` gives, back under the wrapped module."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _ROOT)]:
        state_dict[prefix + _ROOT + key[len(prefix):]] = state_dict.pop(key)


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> Qwen35LanguageModel:
    """The model for a Qwen3.5 text config at this pipeline stage; ``language``: the part's native
    module (its ``LanguageModelBuilder``)."""
    _, model = build_stage(cfg, cfg, language.LanguageModelBuilder(cfg, params_dtype))
    return Qwen35LanguageModel(model, cfg.vocab_size).to(params_dtype)
