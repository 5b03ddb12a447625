"""The dense decoder part of a whole VLM on mcore: Llama / Mistral / Qwen2-style ``GPTModel`` layers.

A language model is a part like a vision tower: :func:`transformer_config` reads the HF
text config (GQA, explicit head widths, q/k/v biases as the model type has them), and the layer
spec and core attention are what ``GPTModel`` is built with. What the decoder cannot reproduce
(sliding windows, scaled RoPE) is refused by name rather than computed differently.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from mmparity.config import decoder_bias_problems, rope_theta
from mmparity.models.core.attention import head_width
from mmparity.models.core.layers import activation_from_hf, layer_spec, vision_transformer_config
from mmparity.models.parts.dense_decoder.config import transformer_fields


# HF text model types whose decoder the native GPT model reproduces exactly.
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")


class CausalCoreAttention(torch.nn.Module):
    """``core_attention`` for the language model's mcore ``SelfAttention``: causal SDPA, CPU or CUDA.

    The ``sbhd`` contract of :class:`mmparity.models.core.attention.BidirectionalCoreAttention`
    (``[s, b, heads, dim]`` in, ``[s, b, heads * dim]`` out; fewer key/value heads than query heads
    for GQA), because mcore's own ``DotProductAttention`` allocates on CUDA. An ``attention_mask``
    (mcore's boolean, True = masked out) narrows the causal mask further. Packed (THD) sequences
    and attention biases are refused rather than silently attended across.
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **unused):
        super().__init__()
        head_dim = head_width(config)
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("CausalCoreAttention does not take an attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise NotImplementedError("CausalCoreAttention does not implement packed (THD) sequences")
        seq, batch, heads, dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != heads:
            # mcore groups query heads by key/value head: query head h reads group h // (heads/groups).
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            causal = torch.ones(seq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            allowed = causal & ~attention_mask.bool()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        # Values may be narrower than queries and keys (multi-latent attention's v_head_dim).
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * value.shape[-1])


class LanguageRotaryEmbedding(RotaryEmbedding):
    """mcore's 1D RoPE table, kept on the module's device.

    Upstream moves its frequencies to the current CUDA device on first use, which fails on CPU
    and ignores ``module.to(device)``; here they are a non-persistent buffer (no state-dict key)
    that follows the module. The table is the same: angles ``position · θ^(-2k/d)`` in fp32,
    laid out ``[a ‖ a]`` for rotate-half (``[a0, a0, a1, a1, …]`` when interleaved).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inv_freq = self.inv_freq
        del self.inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # The angles stay fp32 under a low-precision cast (only the device follows), and the
        # parent's per-length table cache would hold tensors of the old device or dtype.
        fp32 = self.inv_freq
        out = super()._apply(fn, *args, **kwargs)
        self.inv_freq = fp32.to(self.inv_freq.device)
        RotaryEmbedding.forward.cache_clear()
        return out

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
        if self.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def language_layer_spec() -> ModuleSpec:
    """A causal GPT layer in the Transformer Engine key spelling (norms fused into the linears)."""
    return layer_spec(CausalCoreAttention, AttnMaskType.causal)


def _text_config_problems(text) -> list[str]:
    """What of an HF text config the native GPT decoder cannot reproduce exactly."""
    problems = []
    if text.model_type not in TEXT_MODEL_TYPES:
        problems.append(f"text model_type {text.model_type!r} (supported: "
                        f"{', '.join(TEXT_MODEL_TYPES)})")
    problems += decoder_bias_problems(text)
    if getattr(text, "sliding_window", None) is not None:
        problems.append(f"sliding_window={text.sliding_window} (the decoder is fully causal)")
    rope_type = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (only unscaled RoPE)")
    return problems


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    """The part's recipe (:func:`~mmparity.models.parts.dense_decoder.config.transformer_fields`)
    with HF's own activation function, for a text config the decoder reproduces exactly."""
    problems = _text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    fields = transformer_fields(text)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **fields)


class LanguageModelBuilder:
    """Builds the dense decoder as Megatron-LM holds it, a ``GPTModel`` with RoPE, for a padded
    vocabulary and a pipeline stage (what a whole VLM's ``language_model`` is)."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32, config=None):
        # ``config``: a part reusing this builder with its own TransformerConfig.
        self.config = transformer_config(text, params_dtype) if config is None else config
        self.max_sequence_length = text.max_position_embeddings
        self.rotary_base = rope_theta(text)

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False) -> GPTModel:
        model = GPTModel(config=self.config, transformer_layer_spec=language_layer_spec(),
                         vocab_size=vocab_size, max_sequence_length=self.max_sequence_length,
                         pre_process=pre_process, post_process=post_process,
                         parallel_output=parallel_output,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                         position_embedding_type="rope", rotary_base=self.rotary_base,
                         scatter_embedding_sequence_parallel=False)
        model.rotary_pos_emb = LanguageRotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=1.0,
            rotary_interleaved=self.config.rotary_interleaved, rotary_base=self.rotary_base,
            use_cpu_initialization=True)
        return model
