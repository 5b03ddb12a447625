"""Gemma 3 whole on mcore, ``LLaVAModel``'s tree: the ``siglip`` family's tower (its last hidden
state, ``ln_post`` applied, no pooling head) as ``vision_model``, the average-pool projector as
``vision_projection`` and the Gemma 3 decoder as ``language_model`` (a ``GPTModel``).

The decoder is a ``GPTModel`` whose layers differ from the dense decoder's in what Gemma 3 adds:

* every RMSNorm scales by ``1 + weight`` in fp32 (``layernorm_zero_centered_gamma``; the q/k norms
  too), the stand-ins of :mod:`mmparity.models.parts.qwen3_5_text.native`;
* four norms per layer. mcore's ``TransformerLayer`` has places for the two pre-norms (fused into
  ``linear_qkv`` and ``linear_fc1``, as Transformer Engine holds them) but none for the two
  "sandwich" norms after attention and after the MLP: they sit on the row-parallel linear whose
  output they normalise, as ``linear_proj.post_layernorm`` and ``linear_fc2.post_layernorm``
  (:class:`PostNormedRowParallelLinear`), the names Megatron-Bridge's Gemma 3 gives them, so that
  the residual add of the layer follows the norm as in HF;
* attention scaled by ``query_pre_attn_scalar ** -0.5``; ``sliding_attention`` layers see the
  last ``sliding_window`` keys and rotate with their own RoPE base, ``full_attention`` layers with
  theirs (linear scaling where the config asks: frequencies divided by the factor);
* the embedding is scaled by ``sqrt(hidden)`` rounded to the parameter dtype, as HF rounds it,
  before the image features take the image tokens' places (the features are not scaled).

Neither soft-cap is computed: transformers' ``Gemma3ForConditionalGeneration`` applies neither the
final logits' (only its text-only ``Gemma3ForCausalLM`` does) nor the attention logits' (its
attention never receives the cap), so a config that sets one is refused
(:func:`~mmparity.models.gemma3.config.config_problems`) rather than checked against nothing.

The mask: HF's training forward (``token_type_ids`` given, as the processor returns them) lets the
tokens of one image attend to each other both ways: full layers see OR(causal, same image),
sliding layers AND(window, OR(causal, same image)) where the window bounds only how far back a key
may be (``key > query - sliding_window``), so an image token also sees its image's later tokens.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mmparity.models.core.layers import (
    get_bias_dropout_add, tolerate_missing_extra_state, vision_transformer_config)
from mmparity.models.core.mla_moe import host_placement
from mmparity.models.core.stages import build_stage, stage_layers
from mmparity.models.gemma3.config import (
    SLIDING, config_problems, layer_rope, transformer_config)
from mmparity.models.llava.native import LLaVAModel
from mmparity.models.parts.deepseek_v3.native import build_gpt_model
from mmparity.models.parts.dense_decoder.native import LanguageRotaryEmbedding
from mmparity.models.parts.gemma_blocks import (
    PerLayerRopeSelfAttention, PostNormedRowParallelLinear, WindowedCoreAttention, default_inv_freq)
from mmparity.models.parts.qwen3_5_text.native import (
    ZeroCentredNormedColumnParallelLinear, ZeroCentredRMSNorm)
from mmparity.models.qwen3_vl_whole.native import Qwen3VLModel
from mmparity.models.siglip import native as tower


def layer_spec(text) -> ModuleSpec:
    types = list(text.layer_types)
    windows = tuple(text.sliding_window if t == SLIDING else None for t in types)
    ropes = tuple(default_inv_freq(text.head_dim, *layer_rope(text, t)) for t in types)
    attention = ModuleSpec(module=PerLayerRopeSelfAttention,
                           params={"attn_mask_type": AttnMaskType.causal, "ropes": ropes},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=ZeroCentredNormedColumnParallelLinear,
                               core_attention=ModuleSpec(module=WindowedCoreAttention, params={"windows": windows}),
                               linear_proj=PostNormedRowParallelLinear, q_layernorm=ZeroCentredRMSNorm,
                               k_layernorm=ZeroCentredRMSNorm))
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ZeroCentredNormedColumnParallelLinear,
                                                          linear_fc2=PostNormedRowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(text) -> TransformerBlockSubmodules:
    spec = layer_spec(text)
    return TransformerBlockSubmodules(layer_specs=stage_layers([spec] * text.num_hidden_layers),
                                      layer_norm=ZeroCentredRMSNorm)


class LanguageModelBuilder:
    """The Gemma 3 decoder as a ``GPTModel`` for a padded vocabulary and a pipeline stage."""

    def __init__(self, text, params_dtype: torch.dtype = torch.float32):
        self.text = text
        self.config = transformer_config(text, params_dtype)
        self.max_sequence_length = text.max_position_embeddings

    def __call__(self, vocab_size: int, *, pre_process: bool, post_process: bool,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False):
        base, _ = layer_rope(self.text, self.text.layer_types[0])
        model = build_gpt_model(self.config, block_spec(self.text), vocab_size, self.max_sequence_length,
                                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                rotary_base=base)
        # GPTModel's own table is unused (each layer rotates with its type's), kept on the host.
        model.rotary_pos_emb = LanguageRotaryEmbedding(
            kv_channels=self.config.kv_channels, rotary_percent=1.0, rotary_interleaved=False,
            rotary_base=base, use_cpu_initialization=True)
        return model


class AveragePoolProjector(MegatronModule):
    """HF ``Gemma3MultiModalProjector`` in Megatron's ``MultimodalProjector`` (affine) place: the
    patch grid average-pooled to ``mm_tokens_per_image`` tokens, then ``encoder``, a column-parallel
    linear (vision -> text width, no bias) with the soft-embedding RMSNorm (``1 + w``) fused in as
    ``encoder.layer_norm_weight``. HF stores the projection (vision, text), multiplied from the
    right; ``encoder.weight`` is its transpose (text, vision), a Linear's layout."""

    def __init__(self, cfg, params_dtype: torch.dtype = torch.float32):
        vc, text = cfg.vision_config, cfg.text_config
        # The norm's fields are what the encoder reads; heads and activation only satisfy
        # TransformerConfig (a single linear has neither).
        config = vision_transformer_config(
            num_layers=1, hidden_size=vc.hidden_size, num_attention_heads=vc.num_attention_heads,
            ffn_hidden_size=text.hidden_size, normalization="RMSNorm", norm_eps=vc.layer_norm_eps,
            activation=F.gelu, gated=False, bias=False, params_dtype=params_dtype, pipelined_stack=False)
        super().__init__(config=config)
        self.patches = vc.image_size // vc.patch_size
        self.kernel = self.patches // math.isqrt(cfg.mm_tokens_per_image)
        self.encoder = ZeroCentredNormedColumnParallelLinear(
            vc.hidden_size, text.hidden_size, config=config, init_method=config.init_method, bias=False,
            gather_output=True, skip_bias_add=False)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """(images, p·p, H) -> (images, (p/k)², H): mean over each k×k block of the raster grid."""
        n, _, h = tokens.shape
        grid = tokens.transpose(1, 2).reshape(n, h, self.patches, self.patches)
        return F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.encoder(self.pool(tokens))
        return out


def image_blocks(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``[b, s]`` the index of the run of image tokens each token is in, -1 for text: one run of
    consecutive image tokens is one image (as HF groups them)."""
    image = input_ids == image_token_id
    before = F.pad(image, (1, 0), value=False)[:, :-1]
    starts = image & ~before
    return torch.where(image, starts.long().cumsum(1) - 1, torch.full_like(input_ids, -1))


def attention_mask(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``[b, 1, s, s]`` mcore's mask (True = masked) of the full layers: OR(causal, same image)."""
    s = input_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
    blocks = image_blocks(input_ids, image_token_id)
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    return ~(causal | same)[:, None]


class Gemma3Model(MegatronModule):
    """ids and images -> logits or the per-token loss.

    Images are ``[n, C, H, W]`` at the tower's size (Gemma 3's processor resizes every image to it),
    in the order their runs of ``mm_tokens_per_image`` image tokens appear in the rows."""

    def __init__(self, vision, projector, language_model, *, image_token_id: int, vocab_size: int,
                 hidden_size: int):
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision_model = vision
        self.vision_projection = projector
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.image_token_id, self.vocab_size = image_token_id, vocab_size
        self.hidden_size = hidden_size
        tolerate_missing_extra_state(self)

    # Where activations enter and leave a pipeline stage: the language model, as Qwen3-VL's.
    set_input_tensor = Qwen3VLModel.set_input_tensor
    pipelined_module = Qwen3VLModel.pipelined_module

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.vision_model(images)  # ln_post applied
        projected = self.vision_projection(tokens)
        return projected.reshape(-1, projected.shape[-1])

    def scaled(self, embedded: torch.Tensor) -> torch.Tensor:
        """HF multiplies the embedding by sqrt(hidden) held in the weights' dtype (bf16 rounds it)."""
        scale = torch.tensor(self.hidden_size ** 0.5, dtype=torch.float32).to(embedded.dtype)
        return embedded * scale.to(embedded.device)

    def attention_mask(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """mcore's mask (True = masked) the layers take: the images' bidirectional blocks."""
        return attention_mask(input_ids, self.image_token_id)

    def embed(self, input_ids: torch.Tensor, images: Optional[torch.Tensor]) -> torch.Tensor:
        image = input_ids == self.image_token_id
        ids = input_ids.masked_fill(image, 0)
        flat = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        embedded = self.scaled(self.language_model.embedding(input_ids=ids, position_ids=flat))  # [s, b, h]
        batch_major = embedded.transpose(0, 1).clone()
        if images is not None and len(images):
            features = self.image_features(images)
            if int(image.sum()) != features.shape[0]:
                raise ValueError(f"{int(image.sum())} image tokens in the ids for {features.shape[0]} image embeddings")
            batch_major[image] = features.to(batch_major.dtype)
        return batch_major.transpose(0, 1).contiguous()

    def forward(self, images: Optional[torch.Tensor], input_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None):
        with host_placement(input_ids.device):
            mask = self.attention_mask(input_ids)
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            decoder_input = self.embed(input_ids, images) if self.pre_process else None
            gather = labels is None
            out = self.language_model(None, positions, mask, decoder_input=decoder_input,
                                      runtime_gather_output=gather)
            if labels is None or not self.post_process:
                return out
            return LLaVAModel._token_loss(self, out, labels.contiguous())


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Gemma3Model:
    problems = config_problems(cfg)
    if problems:
        raise ValueError("unsupported Gemma 3 model: " + "; ".join(problems))
    text, vc = cfg.text_config, cfg.vision_config
    projector = []

    def build_tower():
        projector.append(AveragePoolProjector(cfg, params_dtype))
        return tower.build_native(vc, params_dtype)

    vision, language_model = build_stage(cfg, text, LanguageModelBuilder(text, params_dtype), tower=build_tower)
    model = Gemma3Model(vision, projector[0] if projector else None, language_model,
                        image_token_id=cfg.image_token_id, vocab_size=text.vocab_size,
                        hidden_size=text.hidden_size)
    return model.to(params_dtype)
