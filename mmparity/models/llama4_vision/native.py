"""Native Llama 4 vision tower: ``ViTModel`` in ``CLIPViTModel``'s key layout, with what Llama 4
adds to CLIP's architecture.

Megatron has no Llama 4 tower. Its layers are CLIP's (pre-LayerNorm with biases, a plain exact-GELU
MLP, bidirectional attention), so the tower takes ``CLIPViTModel``'s names (``conv1``,
``class_token``, ``position_embeddings``, ``ln_pre``, ``decoder.layers``, ``ln_post``) and the layer
spec every CLIP-like tower here uses. What Llama 4 does differently, as transformers does it:

* the patch embedding is a bias-free linear over unfolded patches: ``conv1`` holds it as a
  ``Conv2d`` weight (the same numbers, ``F.unfold`` flattens a patch in (C, P, P) order);
* the class token is appended *after* the patches, and the position table's last row is its own;
  the native tower keeps transformers' order, so the table needs no permutation;
* 2D RoPE on q/k of every layer (:class:`Llama4VisionRope`); the class token's angles are zero;
* ``ln_post`` on every token, then the class token is dropped and the patch grid pixel-shuffled
  (each 2x2 block of a ratio-0.5 shuffle becomes one token, patch-major: top-left, top-right,
  bottom-left, bottom-right) and passed through the adapter MLP (``adapter.linear_fc1`` ->
  GELU -> ``adapter.linear_fc2`` -> GELU, no biases, replicated over TP ranks).

Tiles are always ``image_size`` square (transformers' position table and RoPE table are fixed):
another size is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from mmparity.config import first_int, rope_theta, vision_of
from mmparity.models.core.layers import activation_from_hf, vision_layer_spec, vision_transformer_config
from mmparity.models.core.mergers import fold_blocks
from mmparity.models.core.vit import ViTModel
from mmparity.models.llama4_vision.config import NORM_EPS, transformer_fields

MODEL_TYPES = ("llama4_vision_model",)
CLASS_TOKEN_LEN = 1


def vision_config(cfg):
    return vision_of(cfg, MODEL_TYPES)


def merge_size(vc) -> int:
    """Patches per side of one pixel-shuffled block: ``1 / pixel_shuffle_ratio``."""
    m = round(1 / vc.pixel_shuffle_ratio)
    if m < 1 or abs(m * vc.pixel_shuffle_ratio - 1) > 1e-9:
        raise ValueError(f"pixel_shuffle_ratio {vc.pixel_shuffle_ratio} is not 1/n for an integer n")
    return m


class Llama4VisionRope(torch.nn.Module):
    """Llama 4's 2D RoPE as raw angles ``(N + 1, 1, 1, head_dim)`` for mcore's interleaved rotation.

    Pair t of a head (t < hd/4) rotates by ``(col + 1)·f[t]``, pair hd/4 + t by ``(row + 1)·f[t]``,
    with f[t] = θ^(-4t/hd): both coordinates count from 1, and the class token (last) gets angle 0,
    so it is not rotated. Each angle is repeated twice in place (mcore rotates pairs 2t, 2t+1, as
    transformers' complex multiplication does)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"Llama 4's 2D RoPE needs a head_dim divisible by 4, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, h_patches: int, w_patches: int, device) -> torch.Tensor:
        # fp32 on every call, not a buffer: a bf16 cast of the model would round the angles.
        quarter = self.head_dim // 4
        freqs = 1.0 / self.theta ** (torch.arange(quarter, dtype=torch.float64, device=device) * 4 / self.head_dim)
        freqs = freqs.float()
        index = torch.arange(h_patches * w_patches, device=device)
        cols, rows = (index % w_patches + 1).float(), (index // w_patches + 1).float()
        angles = torch.cat([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)
        angles = torch.cat([angles, angles.new_zeros(CLASS_TOKEN_LEN, angles.shape[-1])])
        return angles.repeat_interleave(2, dim=-1)[:, None, None, :]


class PixelShuffleAdapter(MegatronModule):
    """transformers' ``vision_adapter``: the pixel-shuffled grid through two bias-free linears,
    each followed by an exact GELU. Plain linears, whole on every TP rank."""

    def __init__(self, config, in_features: int, hidden: int, out_features: int):
        super().__init__(config=config)
        self.linear_fc1 = torch.nn.Linear(in_features, hidden, bias=False, dtype=config.params_dtype)
        self.linear_fc2 = torch.nn.Linear(hidden, out_features, bias=False, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear_fc2(F.gelu(self.linear_fc1(x))))


class Llama4VisionTower(ViTModel):
    """``ViTModel`` with Llama 4's class token order, RoPE, pixel shuffle and adapter (module doc)."""

    def __init__(self, transformer_config, layer_spec, *, vc):
        size, patch = first_int(vc.image_size), first_int(vc.patch_size)
        super().__init__(transformer_config, layer_spec, patch_dim=patch, img_h=size, img_w=size,
                         in_channels=vc.num_channels, patch_embed_path="conv1", patch_embed_bias=False,
                         add_class_token=True, class_token_len=CLASS_TOKEN_LEN, ln_pre=True, ln_pre_eps=NORM_EPS,
                         pos_emb_type="learned_absolute", ln_post="tokens", ln_post_eps=NORM_EPS)
        self.merge = merge_size(vc)
        grid = size // patch
        if grid % self.merge:
            raise ValueError(f"a {grid}x{grid} patch grid does not pixel-shuffle into "
                             f"{self.merge}x{self.merge} blocks")
        self.rope = Llama4VisionRope(transformer_config.kv_channels, rope_theta(vc))
        self.adapter = (PixelShuffleAdapter(transformer_config, transformer_config.hidden_size * self.merge ** 2,
                                            vc.projector_input_dim, vc.projector_output_dim)
                        if self.post_process else None)

    def _position(self, tokens: torch.Tensor, h_patches: int, w_patches: int) -> torch.Tensor:
        """Patches, then the class token, plus the whole table (transformers' order and sizes)."""
        if (h_patches, w_patches) != (self.img_h // self.patch_dim, self.img_w // self.patch_dim):
            raise ValueError(f"Llama 4 tiles are {self.img_h}x{self.img_w} pixels; got a "
                             f"{h_patches * self.patch_dim}x{w_patches * self.patch_dim} image")
        cls = self.class_token.to(tokens.dtype).expand(tokens.shape[0], -1, -1)
        # Called, not read as ``.weight``: check --low-memory streams a module's weights in when it runs.
        table = self.position_embeddings(h_patches, w_patches)
        return torch.cat([tokens, cls], dim=1) + table.to(tokens.dtype)

    def forward(self, pixel_values: torch.Tensor, attention_mask=None, imgs_sizes=None,
                packed_seq_params=None, return_pooled: bool = False):
        """(tiles, C, S, S) -> (tiles, (S/P/m)², projector_output_dim)."""
        if imgs_sizes is not None:
            raise ValueError("Llama 4 tiles all have the table's size: pass them as one (B, C, H, W) batch")
        tokens, _, _, grids = self._embed(pixel_values, None)
        h, w = grids[0]
        if (h * self.patch_dim, w * self.patch_dim) != (self.img_h, self.img_w):
            raise ValueError(f"Llama 4 tiles are {self.img_h}x{self.img_w} pixels; got "
                             f"{h * self.patch_dim}x{w * self.patch_dim}")
        rope = self.rope(h, w, pixel_values.device)
        hidden = self.run_stack(tokens, rope, None, attention_mask, packed_seq_params)
        if self.post_process:
            hidden = self.ln_post(hidden)[:, : h * w]
            hidden = self.adapter(fold_blocks(hidden, h, w, self.merge, "patch"))
        return (hidden, None) if return_pooled else hidden


def transformer_config(vc, params_dtype: torch.dtype = torch.float32, **overrides):
    fields = transformer_fields(vc)
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, **{**fields, **overrides})


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Llama4VisionTower:
    """The tower from an HF ``Llama4VisionConfig`` (or a whole Llama 4 config holding one)."""
    vc = vision_config(cfg)
    return Llama4VisionTower(transformer_config(vc, params_dtype), vision_layer_spec(), vc=vc)
