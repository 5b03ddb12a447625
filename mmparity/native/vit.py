"""Generic native ViT (Pixtral, Pixtral-Large, CLIP, SigLIP) on an mcore ``TransformerBlock``.

Follows the API of megatron-core's ``models.vision.vit_model`` (seed 000). Deliberate deviations
are listed on each class.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.native.attention import make_packed_seq_params
from mmparity.native.layers import layer_norm, tolerate_missing_extra_state
from mmparity.native.rope import Pixtral2DRotaryEmbedding

ImageSizes = Union[Sequence[Tuple[int, int]], torch.Tensor]


class PatchEmbedding(torch.nn.Module):
    """Conv2d patch extractor, no position embedding (``patch_conv.*`` in checkpoints)."""

    def __init__(self, in_channels: int, hidden_size: int, patch_dim: int, bias: bool = False):
        super().__init__()
        self.patch_dim = patch_dim
        self.in_channels = in_channels
        self.conv = torch.nn.Conv2d(in_channels, hidden_size, kernel_size=patch_dim,
                                    stride=patch_dim, bias=bias)

    def forward(self, x: torch.Tensor):
        """(B, C, H, W) -> ((B, N, hidden), h_patches, w_patches); (B, N, C·P·P) rows -> (B, N, hidden).

        Both paths go through ``__call__`` so that forward hooks (divergence localisation) see them.
        """
        if x.dim() == 3:
            return self.forward_patches(x)
        check_image_size(x.shape[-2], x.shape[-1], self.patch_dim)
        x = self.conv(x.to(self.conv.weight.dtype))
        b, hidden, h_patches, w_patches = x.shape
        return x.flatten(2).transpose(1, 2), h_patches, w_patches

    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-patchified (B, N, C·P·P) rows, flattened in (C, P, P) order -> (B, N, hidden)."""
        expected = self.in_channels * self.patch_dim ** 2
        if x.shape[-1] != expected:
            raise ValueError(f"patch rows must have width C*P*P = {expected}, got {x.shape[-1]}")
        weight = self.conv.weight.flatten(1)
        return torch.nn.functional.linear(x.to(weight.dtype), weight, self.conv.bias)


def check_image_size(height: int, width: int, patch_dim: int) -> None:
    if height % patch_dim or width % patch_dim or height <= 0 or width <= 0:
        raise ValueError(
            f"image size {height}x{width} is not a positive multiple of the patch size {patch_dim}")


def _dynamic_patch_grid_lists(imgs_sizes: ImageSizes, patch_dim: int
                              ) -> Tuple[List[Tuple[int, int]], List[int]]:
    """Per-image (h_patches, w_patches) and token counts as host lists.

    Refuses a CUDA tensor: reading it would synchronise the device, which is exactly what the
    packed path must never do once per layer. Callers keep image sizes on the host.
    """
    if isinstance(imgs_sizes, torch.Tensor):
        if imgs_sizes.is_cuda:
            raise ValueError("imgs_sizes must live on the host: reading a CUDA tensor would "
                             "synchronise the device; pass a list or a CPU tensor")
        imgs_sizes = [tuple(int(v) for v in row) for row in imgs_sizes.tolist()]
    grids: List[Tuple[int, int]] = []
    for height, width in imgs_sizes:
        check_image_size(int(height), int(width), patch_dim)
        grids.append((int(height) // patch_dim, int(width) // patch_dim))
    return grids, [h * w for h, w in grids]


def _dynamic_patch_grid(imgs_sizes: ImageSizes, patch_dim: int, device: torch.device
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tensor form: ``grid_hw`` (n, 2) and ``cu_seqlens`` (n + 1,) int32 on ``device``."""
    grids, seqlens = _dynamic_patch_grid_lists(imgs_sizes, patch_dim)
    grid_hw = torch.tensor(grids, dtype=torch.int64).view(-1, 2).to(device)
    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return grid_hw, cu


def _cat_rope(chunks: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-image rotary tables (N_i, 1, 1, d) along the token axis."""
    if not chunks:
        raise ValueError("no rotary tables to concatenate")
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)


class VisionNorm(torch.nn.Module):
    """LayerNorm or RMSNorm with the parameter names mcore norms use (``weight``/``bias``)."""

    def __init__(self, hidden_size: int, eps: float, kind: str, dtype=torch.float32):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.kind)


class ViTModel(MegatronModule):
    """Generic vision transformer on an mcore TransformerBlock (Pixtral configuration here).

    Static input ``(B, C, H, W)`` -> ``(B, N, hidden)``. Dynamic input: pre-patchified
    ``(1, ΣN, C·P·P)`` rows plus ``imgs_sizes`` (pixels, one (H, W) per image), run as one packed
    sequence in which each image attends only to itself -> ``(1, ΣN, hidden)``.

    Deviations from the seed: ``imgs_sizes`` may also accompany an already-patchified input only
    (no padded pixel canvas), and the rope table size is validated rather than silently clamped.
    """

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec,
                 patch_dim: int = 16, img_h: int = 1024, img_w: int = 1024, in_channels: int = 3,
                 patch_embed_bias: bool = False, add_class_token: bool = False,
                 class_token_len: int = 0, ln_pre: bool = True, ln_pre_eps: Optional[float] = None,
                 pos_emb_type: str = "rope2d", rope_theta: float = 10000.0,
                 use_merger: bool = False, spatial_merge_size: int = 2, pg_collection=None,
                 vp_stage: Optional[int] = None):
        super().__init__(config=transformer_config)
        from megatron.core import parallel_state

        if pos_emb_type != "rope2d" or add_class_token or use_merger:
            raise NotImplementedError(
                "this ViTModel build supports the Pixtral configuration (rope2d, no CLS, no merger)")
        cfg = transformer_config
        self.patch_dim, self.img_h, self.img_w = patch_dim, img_h, img_w
        self.hidden_size = cfg.hidden_size
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.patch_conv = PatchEmbedding(in_channels, cfg.hidden_size, patch_dim, patch_embed_bias)
        self.ln_pre = (VisionNorm(cfg.hidden_size, ln_pre_eps or cfg.layernorm_epsilon,
                                  cfg.normalization, cfg.params_dtype) if ln_pre else None)
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.rotary_pos_emb = Pixtral2DRotaryEmbedding(
            head_dim, max(img_h, img_w) // patch_dim, rope_theta)
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec,
                                        post_layer_norm=False, pre_process=self.pre_process,
                                        post_process=self.post_process)
        tolerate_missing_extra_state(self)

    @property
    def num_patches_per_image(self) -> int:
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, Optional[list]]:
        """Patch embedding + ln_pre -> (tokens (B, N, H), rotary (N, 1, 1, d), seqlens or None)."""
        if imgs_sizes is None:
            tokens, h_patches, w_patches = self.patch_conv(pixel_values)
            rope = self.rotary_pos_emb(h_patches, w_patches, tokens.device)
            seqlens = None
        else:
            grids, seqlens = _dynamic_patch_grid_lists(imgs_sizes, self.patch_dim)
            if pixel_values.dim() != 3 or pixel_values.shape[0] != 1:
                raise ValueError("dynamic input must be pre-patchified rows of shape (1, ΣN, C*P*P)")
            if pixel_values.shape[1] != sum(seqlens):
                raise ValueError(f"imgs_sizes describe {sum(seqlens)} patches but the input has "
                                 f"{pixel_values.shape[1]} rows")
            tokens = self.patch_conv(pixel_values)
            rope = _cat_rope([self.rotary_pos_emb(h, w, tokens.device) for h, w in grids])
        if self.ln_pre is not None:
            tokens = self.ln_pre(tokens)
        return tokens, rope, seqlens

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None) -> torch.Tensor:
        tokens, rope, seqlens = self.embed(pixel_values, imgs_sizes)
        if seqlens is not None and packed_seq_params is None:
            packed_seq_params = make_packed_seq_params(seqlens, tokens.device)
        hidden = tokens.transpose(0, 1).contiguous() if self.pre_process else None
        hidden = self.decoder(hidden, attention_mask, rotary_pos_emb=rope,
                              packed_seq_params=packed_seq_params)
        return hidden.transpose(0, 1).contiguous()
