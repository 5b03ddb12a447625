"""Gemma 4 E2B / E4B's per-layer inputs and shared keys / values on mcore (the layout and why:
:mod:`mmparity.models.parts.gemma4_text.per_layer`).

One forward hands state between modules that mcore's block does not connect: the per-layer inputs
the first stage computes reach every layer, and a shared layer reads the keys and values an earlier
layer computed. Both travel in a :class:`Relay` the builder gives those modules (one per model);
the whole model fills it before the decoder runs and empties it after.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mmparity.config import padded_vocab_size
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core.stages import stage_layers
from mmparity.models.parts.gemma4_text import native
from mmparity.models.parts.gemma4_text.native import RMSNorm, ScaledLayer
from mmparity.models.parts.gemma4_text.per_layer import mlp_width, ple_dim, shared_from
from mmparity.models.parts.gemma_blocks import PerLayerRopeSelfAttention
from mmparity.parallel import runtime


class Relay:
    """This forward's per-layer inputs (``[s, b, layers, P]``) and the keys / values of the layers
    shared ones read, by layer index."""

    def __init__(self):
        self.inputs = None
        self.kv: dict = {}

    def clear(self):
        self.inputs, self.kv = None, {}

    def layer_input(self, i: int) -> torch.Tensor:
        if self.inputs is None:
            raise RuntimeError("a Gemma 4 layer with per-layer inputs ran without them: run the whole model "
                               "(its first pipeline stage computes them)")
        return self.inputs[:, :, i]


def _weight(config, rows: int, cols: int) -> torch.nn.Parameter:
    weight = torch.empty(rows, cols, dtype=config.params_dtype)
    config.init_method(weight)
    return torch.nn.Parameter(weight)


class Linear(torch.nn.Module):
    """A bias-free linear whole on every TP rank (key ``weight``)."""

    def __init__(self, config, in_features: int, out_features: int):
        super().__init__()
        self.weight = _weight(config, out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    # HF holds the factor in the weights' dtype (bf16 rounds it), as the word embedding's.
    return x * torch.tensor(factor, dtype=torch.float32).to(x.dtype).to(x.device)


class PerLayerInputs(torch.nn.Module):
    """The per-layer inputs of every layer from the ids and the input embeddings (images in place):
    the table looked up (``sqrt(P)``-scaled) plus the input embeddings projected to ``layers · P``
    (scaled by ``hidden^-½``, each layer's ``P`` RMS-normed), the sum scaled by ``2^-½``. Image
    (and any multimodal placeholder) positions look up the pad token's row, as transformers does."""

    def __init__(self, config, text, vocab_size: int, relay: Relay):
        super().__init__()
        self.layers, self.width = text.num_hidden_layers, int(text.hidden_size_per_layer_input)
        self.hidden, self.eps = text.hidden_size, text.rms_norm_eps
        self.embeddings = VocabParallelEmbedding(vocab_size, self.layers * self.width, init_method=config.init_method,
                                                 config=config)
        self.projection = Linear(config, text.hidden_size, self.layers * self.width)
        self.projection_norm = RMSNorm(config, self.width, text.rms_norm_eps)
        # The table's scaled output, as a module of its own (no state) that parity pairs with HF's.
        self.looked_up = torch.nn.Identity()
        self.relay = relay

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[b, s]`` (placeholders already the pad id), ``embedded`` ``[s, b, h]``
        -> ``[s, b, layers, P]``, which the layers read from the relay."""
        looked_up = self.looked_up(_scaled(self.embeddings(input_ids.t().contiguous()), self.width ** 0.5))
        projected = self.projection(embedded) * self.hidden ** -0.5
        shape = (*embedded.shape[:-1], self.layers, self.width)
        projected = self.projection_norm(projected.reshape(shape))
        self.relay.inputs = (projected + looked_up.reshape(shape)) * 2.0 ** -0.5
        return self.relay.inputs


class PerLayerInputLayer(ScaledLayer):
    """Gemma 4's layer with its per-layer input (where the model has one) added after the MLP, and
    its MLP doubled where the config says so for shared layers. ``width``: ``P`` (0: none)."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, text=None, relay=None, **kwargs):
        number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"))
        ffn = mlp_width(text, number - 1)
        if ffn != config.ffn_hidden_size:
            config = dataclasses.replace(config, ffn_hidden_size=ffn)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.relay = relay
        width = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
        if width:
            self.per_layer_input_gate = Linear(config, config.hidden_size, width)
            self.per_layer_projection = Linear(config, width, config.hidden_size)
            self.post_per_layer_input_norm = RMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        else:
            self.per_layer_input_gate = None

    def before_scale(self, out: torch.Tensor) -> torch.Tensor:
        if self.per_layer_input_gate is None:
            return out
        gated = self.config.activation_func(self.per_layer_input_gate(out))
        gated = gated * self.relay.layer_input(self.layer_number - 1).to(out.dtype)
        return out + self.post_per_layer_input_norm(self.per_layer_projection(gated))


class SharedKVSelfAttention(PerLayerRopeSelfAttention):
    """Gemma 4's attention where some layers share keys and values. A layer another reads from
    leaves its keys (normed, not yet rotated) and values (not yet normed) in the relay; a shared
    layer projects queries only (``linear_q``, with the input norm fused) and takes those: it
    rotates the keys with the same table and norms the values the same way, so it attends over
    exactly what the earlier layer did."""

    def __init__(self, config, submodules, layer_number: int, *args, text=None, relay=None, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        sources = shared_from(text)
        self.relay, self.index = relay, layer_number - 1
        self.source = sources[self.index]
        self.stores = self.index in set(s for s in sources if s is not None)
        if self.source is not None:
            # transformers builds no key / value projection or key norm here: neither does this.
            self.linear_qkv, self.k_layernorm = None, None
            self.linear_q = submodules.linear_qkv(
                self.config.hidden_size, self.query_projection_size, config=self.config,
                init_method=self.config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="q", tp_group=self.pg_collection.tp)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self.source is None:
            query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                                     output_gate=output_gate, split_qkv=split_qkv)
            if self.stores:
                self.relay.kv[self.index] = (key, value)
            return query, key, value
        query, _ = self.linear_q(hidden_states)
        query = query.view(*query.shape[:-1], -1, self.hidden_size_per_attention_head)
        key, value = self.relay.kv[self.source]
        return self.q_layernorm(query), key, value


def layer_spec(text, relay: Relay):
    """The part's layer spec with the layer and attention above, both handed the relay."""
    base = native.layer_spec(text)
    attention = base.submodules.self_attention
    attention = dataclasses.replace(attention, module=SharedKVSelfAttention,
                                    params={**attention.params, "text": text, "relay": relay})
    submodules = dataclasses.replace(base.submodules, self_attention=attention)
    return dataclasses.replace(base, module=PerLayerInputLayer, submodules=submodules,
                               params={**(base.params or {}), "text": text, "relay": relay})


class LanguageModelBuilder(native.LanguageModelBuilder):
    """The part's builder for a model with per-layer inputs or shared keys / values: its layers
    and attention are the ones above, and the first stage's embedding holds
    :class:`PerLayerInputs` as ``embedding.per_layer``. ``relay``: what the whole model fills."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32):
        super().__init__(text, params_dtype)
        self.relay = Relay()

    @staticmethod
    def unbuilt(text) -> list[str]:
        return []

    def block(self):
        return native.TransformerBlockSubmodules(
            layer_specs=stage_layers([native.with_moe(self.text, layer_spec(self.text, self.relay))]
                                     * self.text.num_hidden_layers),
            layer_norm=RMSNorm)

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool, **kwargs):
        model = super().__call__(vocab_size, pre_process=pre_process, post_process=post_process, **kwargs)
        if pre_process and ple_dim(self.text):
            vocab = padded_vocab_size(int(self.text.vocab_size_per_layer_input), VOCAB_MULTIPLE,
                                      tp=runtime.current_layout().tp)
            model.embedding.per_layer = PerLayerInputs(self.config, self.text, vocab, self.relay)
        model.per_layer_relay = self.relay
        return model


def needed(text) -> bool:
    """Whether ``text`` needs this module's builder."""
    return bool(ple_dim(text) or getattr(text, "num_kv_shared_layers", 0))
