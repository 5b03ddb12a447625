"""Generic native ViT (Pixtral, Pixtral-Large, CLIP, SigLIP) on an mcore ``TransformerBlock``.

Follows the API of Megatron-LM ``megatron/core/models/vision/vit_model.py``. Deliberate deviations
are listed on each class. Where upstream's design and the HF function differ, the HF
function wins (it is the parity reference) and the class docstring says so.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from mmparity.models.core.attention import BidirectionalCoreAttention, head_width, make_packed_seq_params
from mmparity.models.core.layers import NormedColumnParallelLinear, layer_norm, tolerate_missing_extra_state
from mmparity.models.core.mergers import fold_blocks
from mmparity.models.core.rope import Pixtral2DRotaryEmbedding
from mmparity.parallel import runtime

ImageSizes = Union[Sequence[Tuple[int, int]], torch.Tensor]


class PatchEmbedding(torch.nn.Conv2d):
    """Conv2d patch extractor, no position embedding. A ``Conv2d`` itself, so that its tensors sit
    where Megatron's classes keep theirs (``conv1.*`` in ``CLIPViTModel``, ``patch_embed.proj.*``
    in ``vit_model.ViTModel``): see ``ViTModel``'s ``patch_embed_path``."""

    def __init__(self, in_channels: int, hidden_size: int, patch_dim: int, bias: bool = False):
        super().__init__(in_channels, hidden_size, kernel_size=patch_dim, stride=patch_dim, bias=bias)
        self.patch_dim = patch_dim

    def forward(self, x: torch.Tensor):
        """(B, C, H, W) -> ((B, N, hidden), h_patches, w_patches); (B, N, C·P·P) rows -> (B, N, hidden).

        Both paths go through ``__call__`` so that forward hooks (divergence localisation) see them.
        """
        if x.dim() == 3:
            return self.forward_patches(x)
        check_image_size(x.shape[-2], x.shape[-1], self.patch_dim)
        x = self._conv_forward(x.to(self.weight.dtype), self.weight, self.bias)
        b, hidden, h_patches, w_patches = x.shape
        return x.flatten(2).transpose(1, 2), h_patches, w_patches

    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-patchified (B, N, C·P·P) rows, flattened in (C, P, P) order -> (B, N, hidden)."""
        expected = self.in_channels * self.patch_dim ** 2
        if x.shape[-1] != expected:
            raise ValueError(f"patch rows must have width C*P*P = {expected}, got {x.shape[-1]}")
        weight = self.weight.flatten(1)
        return torch.nn.functional.linear(x.to(weight.dtype), weight, self.bias)


def _set_submodule(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """``root.<path> = module``, with plain containers for the intermediate names."""
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            setattr(root, part, torch.nn.Module())
        root = getattr(root, part)
    setattr(root, name, module)


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


class LearnedPositionEmbedding(torch.nn.Module):
    """Learned absolute position table ``weight``: ``class_token_len`` class rows, then a raster grid.

    ``forward(h, w)`` returns ``(class_token_len + h·w, hidden)``. At the table's own grid the table
    is returned as is; any other grid is resampled the way HF's ``interpolate_pos_encoding=True``
    does for CLIP and SigLIP: the grid part viewed as an image, bicubic, ``align_corners=False``,
    no antialias, in the parameter dtype; the class rows are never resampled.
    """

    def __init__(self, grid_h: int, grid_w: int, hidden_size: int, class_token_len: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.grid_h, self.grid_w, self.class_token_len = grid_h, grid_w, class_token_len
        self.weight = torch.nn.Parameter(
            torch.zeros(class_token_len + grid_h * grid_w, hidden_size, dtype=dtype))

    def forward(self, h_patches: int, w_patches: int) -> torch.Tensor:
        if (h_patches, w_patches) == (self.grid_h, self.grid_w):
            return self.weight
        hidden = self.weight.shape[-1]
        cls, grid = self.weight[: self.class_token_len], self.weight[self.class_token_len:]
        image = grid.view(1, self.grid_h, self.grid_w, hidden).permute(0, 3, 1, 2)
        image = F.interpolate(image, size=(h_patches, w_patches), mode="bicubic",
                              align_corners=False)
        grid = image.permute(0, 2, 3, 1).reshape(h_patches * w_patches, hidden)
        return torch.cat([cls, grid], dim=0) if self.class_token_len else grid


class PixtralLargePatchMerger(torch.nn.Module):
    """Pixtral-Large's 2x2 merger: RMSNorm per token, fold m x m blocks, Linear m²H -> H (no bias).

    Equals HF ``Mistral3MultiModalProjector.norm`` followed by ``Mistral3PatchMerger``. Inside a
    merged vector the layout is channel-major (element ``c·m² + r·m + s`` is channel c of the patch
    at row r, column s of the block), the order ``F.unfold`` produces; blocks are row-major.
    :meth:`merge` is the merger without the norm (exactly ``Mistral3PatchMerger``).

    Deviations from upstream: ``norm_eps`` is explicit, because HF takes the epsilon from the *text*
    config (``rms_norm_eps``), not from the vision tower's norms; ``forward`` also takes per-image
    ``grids`` for a packed (dynamic-resolution) sequence. A grid side that ``spatial_merge_size``
    does not divide loses its last row / column, as ``F.unfold`` (and so HF) does.
    """

    def __init__(self, transformer_config: TransformerConfig, spatial_merge_size: int = 2,
                 norm_eps: Optional[float] = None):
        super().__init__()
        cfg = transformer_config
        self.spatial_merge_size = m = spatial_merge_size
        self.hidden_size = cfg.hidden_size
        eps = cfg.layernorm_epsilon if norm_eps is None else norm_eps
        # Megatron's PixtralLargePatchMerger names: pre_norm (HF's norm), linear_fc1 (HF's
        # merging_layer).
        self.pre_norm = VisionNorm(cfg.hidden_size, eps, "RMSNorm", cfg.params_dtype)
        self.linear_fc1 = torch.nn.Linear(cfg.hidden_size * m * m, cfg.hidden_size, bias=False,
                                          dtype=cfg.params_dtype)

    def fold(self, x: torch.Tensor, h_patches: int, w_patches: int) -> torch.Tensor:
        """(..., h·w, H) raster tokens -> (..., hb·wb, H·m²) channel-major block vectors."""
        return fold_blocks(x, h_patches, w_patches, self.spatial_merge_size, "channel",
                           drop_remainder=True)

    def merge(self, tokens: torch.Tensor, grids: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """Packed (ΣN, H) tokens of images with ``grids`` -> (ΣM, H); no norm."""
        counts = [h * w for h, w in grids]
        if tokens.shape[0] != sum(counts):
            raise ValueError(f"grids describe {sum(counts)} tokens, got {tokens.shape[0]}")
        parts = [self.fold(t, h, w) for t, (h, w) in zip(tokens.split(counts), grids)]
        return self.linear_fc1(torch.cat(parts, dim=0))

    def forward(self, x: torch.Tensor, h_patches: Optional[int] = None,
                w_patches: Optional[int] = None, *,
                grids: Optional[Sequence[Tuple[int, int]]] = None) -> torch.Tensor:
        """(B, h·w, H) -> (B, hb·wb, H); with ``grids``: packed (1, ΣN, H) -> (1, ΣM, H)."""
        normed = self.pre_norm(x)
        if grids is not None:
            if x.dim() != 3 or x.shape[0] != 1:
                raise ValueError("a packed merger input must have shape (1, ΣN, H)")
            return self.merge(normed[0], grids).unsqueeze(0)
        if h_patches is None or w_patches is None:
            raise ValueError("static merger input needs h_patches and w_patches")
        return self.linear_fc1(self.fold(normed, h_patches, w_patches))


class AttentionPoolingHead(MegatronModule):
    """Multi-head attention pooling (SigLIP's ``vision_use_head``) from mcore building blocks.

    A learned ``probe`` (1, P, H) cross-attends to the image tokens (mcore ``CrossAttention``:
    ``linear_q``, ``linear_kv`` with per-head ``[k_h; v_h]`` rows, ``linear_proj``), then
    ``x + MLP(LayerNorm(x))`` with the norm fused into ``mlp.linear_fc1`` as in the encoder layers.
    Returns the first probe's vector per image, as HF ``SiglipMultiheadAttentionPoolingHead``.
    Not in Megatron-LM, whose ``ViTModel`` has no pooling head.
    """

    def __init__(self, config: TransformerConfig, num_probes: int = 1):
        super().__init__(config=config)
        self.probe = torch.nn.Parameter(
            torch.zeros(1, num_probes, config.hidden_size, dtype=config.params_dtype))
        self.attention = CrossAttention(
            config=config,
            submodules=CrossAttentionSubmodules(
                linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                core_attention=BidirectionalCoreAttention, linear_proj=RowParallelLinear),
            layer_number=1, attn_mask_type=AttnMaskType.no_mask)
        self.mlp = MLP(config=config, submodules=MLPSubmodules(
            linear_fc1=NormedColumnParallelLinear, linear_fc2=RowParallelLinear),
            ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, hidden: torch.Tensor, seqlens: Optional[List[int]] = None) -> torch.Tensor:
        """(B, N, H) -> (B, H); packed (1, ΣN, H) with ``seqlens`` -> (len(seqlens), H)."""
        mask = None
        if seqlens is None:
            kv = hidden.transpose(0, 1)
        else:
            # Pad the segments to one batch; padded keys are masked out (True = masked, mcore).
            segments = hidden[0].split(list(seqlens))
            longest = max(seqlens)
            kv = hidden.new_zeros(longest, len(segments), hidden.shape[-1])
            for b, segment in enumerate(segments):
                kv[: segment.shape[0], b] = segment
            if len(set(seqlens)) > 1:
                lengths = torch.tensor(seqlens, device=hidden.device)
                mask = (torch.arange(longest, device=hidden.device)[None, :] >= lengths[:, None])
                mask = mask[:, None, None, :]
        batch = kv.shape[1]
        query = self.probe.to(kv.dtype).transpose(0, 1).expand(-1, batch, -1).contiguous()
        out, bias = self.attention(query, attention_mask=mask, key_value_states=kv.contiguous())
        if bias is not None:
            out = out + bias
        mlp_out, mlp_bias = self.mlp(out)
        out = out + mlp_out + (mlp_bias if mlp_bias is not None else 0)
        return out[0]


POS_EMB_TYPES = ("rope2d", "learned_absolute", "none")
LN_POST_SCOPES = ("tokens", "pooled")
POOLINGS = ("class_token", "attention")


class VisionTower(MegatronModule):
    """What every native tower shares: the nominal patch count and the pipeline entry point.

    Subclasses set ``img_h``, ``img_w``, ``patch_dim`` and ``decoder`` (an mcore TransformerBlock).
    Under pipeline parallelism a tower builds its pre-process modules (patch embedding, class
    token, position embedding, ``ln_pre``) only on the first stage and its post-process modules
    (final norms, heads, mergers, projectors) only on the last; the absent ones are None.
    Parameter-free work (patch grids, RoPE tables, sequence lengths) runs on every stage.
    """

    @property
    def num_patches_per_image(self) -> int:
        """Patches of one image at the nominal ``img_h`` x ``img_w``."""
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline-parallel entry point: the previous stage's output replaces the embeddings."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        """Where activations enter and leave a pipeline stage (see ``native.core.pipeline``)."""
        return self.decoder

    def run_stack(self, tokens: torch.Tensor, rope: torch.Tensor, seqlens: Optional[list],
                  attention_mask=None, packed_seq_params=None) -> torch.Tensor:
        """Batch-first tokens through the mcore block; packed input (``seqlens``) attends per image."""
        if seqlens is not None and packed_seq_params is None:
            device = tokens.device if tokens is not None else next(self.decoder.parameters()).device
            packed_seq_params = make_packed_seq_params(seqlens, device)
        hidden = tokens.transpose(0, 1).contiguous() if self.pre_process else None
        hidden = self.decoder(hidden, attention_mask, rotary_pos_emb=rope,
                              packed_seq_params=packed_seq_params)
        return hidden.transpose(0, 1).contiguous()


class TowerWithProjection(MegatronModule):
    """A tower as ``vision_model`` and its projector as ``vision_projection`` (``LLaVAModel``'s
    names, so the keys are Megatron's). Pipeline stages are the tower's; the projector is built on
    the last one only (``make_projection`` is not called elsewhere)."""

    def __init__(self, vision_model: VisionTower, make_projection):
        super().__init__(config=vision_model.config)
        self.vision_model = vision_model
        self.pre_process, self.post_process = vision_model.pre_process, vision_model.post_process
        self.vision_projection = make_projection() if self.post_process else None
        tolerate_missing_extra_state(self)

    @property
    def patch_dim(self) -> int:
        return self.vision_model.patch_dim

    def set_input_tensor(self, input_tensor) -> None:
        self.vision_model.set_input_tensor(input_tensor)

    def pipelined_module(self) -> torch.nn.Module:
        return self.vision_model.pipelined_module()


class ViTModel(VisionTower):
    """Generic vision transformer on an mcore TransformerBlock: Pixtral, Pixtral-Large, CLIP, SigLIP.

    Static input ``(B, C, H, W)`` -> ``(B, N, hidden)``. Dynamic input: pre-patchified
    ``(1, ΣN, C·P·P)`` rows plus ``imgs_sizes`` (pixels, one (H, W) per image), run as one packed
    sequence in which each image attends only to itself -> ``(1, ΣT, hidden)``, where each image
    contributes ``class_token_len + h·w`` tokens (its class tokens first), or ``hb·wb`` merged
    tokens with ``use_merger``.

    Order of the embedding stage: patch conv -> class token(s) prepended -> learned position
    embedding added (resampled per image when the grid differs from ``img_h, img_w``) -> ``ln_pre``.
    This is HF CLIP's order. Upstream's design normalises with ``ln_pre`` before adding
    the class token and position embedding, which is a different function for CLIP; for Pixtral
    (no class token, RoPE) both orders coincide.

    Beyond upstream (HF-equivalent behaviour its ViTModel lacks):

    * ``ln_post``: ``"tokens"`` normalises every output token (SigLIP ``post_layernorm``);
      ``"pooled"`` normalises only the pooled vector (CLIP applies ``post_layernorm`` to the class
      token, its ``last_hidden_state`` is un-normalised). ``ln_post_eps`` defaults to the config's.
    * ``pooling``: ``"class_token"`` (CLIP ``pooler_output``) or ``"attention"`` (SigLIP's
      attention-pooling head); read it with ``forward(..., return_pooled=True)``.
    * ``merger_norm_eps``: the merger's RMSNorm epsilon (HF takes it from the text config).
    * ``ln_post_kind``: the final norm's kind where it is not the layers' (InternViT's RMSNorm
      layers end in a LayerNorm).

    Other deviations from upstream: ``imgs_sizes`` may also accompany an already-patchified input
    only (no padded pixel canvas), and the rope table size is validated rather than silently
    clamped.
    """

    def __init__(self, transformer_config: TransformerConfig, transformer_layer_spec,
                 patch_dim: int = 16, img_h: int = 1024, img_w: int = 1024, in_channels: int = 3,
                 patch_embed_bias: bool = False, add_class_token: bool = False,
                 class_token_len: int = 0, ln_pre: bool = True, ln_pre_eps: Optional[float] = None,
                 pos_emb_type: str = "rope2d", rope_theta: float = 10000.0,
                 use_merger: bool = False, spatial_merge_size: int = 2, pg_collection=None,
                 vp_stage: Optional[int] = None, *, ln_post: Optional[str] = None,
                 ln_post_eps: Optional[float] = None, pooling: Optional[str] = None,
                 merger_norm_eps: Optional[float] = None, patch_embed_path: str = "patch_embed.proj",
                 ln_post_kind: Optional[str] = None):
        super().__init__(config=transformer_config)
        cfg = transformer_config
        problems = []
        if pos_emb_type not in POS_EMB_TYPES:
            problems.append(f"pos_emb_type must be one of {POS_EMB_TYPES}, got {pos_emb_type!r}")
        if add_class_token and class_token_len < 1:
            problems.append("add_class_token needs class_token_len >= 1")
        if add_class_token and pos_emb_type == "rope2d":
            problems.append("class tokens have no 2D RoPE position; use learned_absolute")
        if ln_post is not None and ln_post not in LN_POST_SCOPES:
            problems.append(f"ln_post must be None or one of {LN_POST_SCOPES}, got {ln_post!r}")
        if pooling is not None and pooling not in POOLINGS:
            problems.append(f"pooling must be None or one of {POOLINGS}, got {pooling!r}")
        if pooling == "class_token" and not add_class_token:
            problems.append("pooling='class_token' needs add_class_token")
        if ln_post == "pooled" and pooling is None:
            problems.append("ln_post='pooled' needs a pooling")
        if use_merger and add_class_token:
            problems.append("the 2x2 merger needs a pure patch grid: no class tokens")
        if problems:
            raise ValueError("invalid ViTModel configuration: " + "; ".join(problems))

        self.patch_dim, self.img_h, self.img_w = patch_dim, img_h, img_w
        self.hidden_size = cfg.hidden_size
        self.pos_emb_type = pos_emb_type
        self.class_token_len = class_token_len if add_class_token else 0
        self.ln_post_scope, self.pooling = ln_post, pooling
        self.in_channels = in_channels
        self.pre_process = runtime.is_first_stage()
        self.post_process = runtime.is_last_stage()
        pre, post = self.pre_process, self.post_process
        # Where the patch conv lives decides its checkpoint keys: Megatron's name for the family.
        self.patch_embed_path = patch_embed_path
        if pre:
            _set_submodule(self, patch_embed_path,
                           PatchEmbedding(in_channels, cfg.hidden_size, patch_dim, patch_embed_bias))
        if self.class_token_len and pre:
            self.class_token = torch.nn.Parameter(
                torch.zeros(1, self.class_token_len, cfg.hidden_size, dtype=cfg.params_dtype))
        self.position_embeddings = None
        if pos_emb_type == "learned_absolute" and pre:
            self.position_embeddings = LearnedPositionEmbedding(
                img_h // patch_dim, img_w // patch_dim, cfg.hidden_size, self.class_token_len,
                cfg.params_dtype)
        self.ln_pre = (VisionNorm(cfg.hidden_size, ln_pre_eps or cfg.layernorm_epsilon,
                                  cfg.normalization, cfg.params_dtype) if ln_pre and pre else None)
        self.rotary_pos_emb = None
        if pos_emb_type == "rope2d":
            head_dim = head_width(cfg)
            self.rotary_pos_emb = Pixtral2DRotaryEmbedding(
                head_dim, max(img_h, img_w) // patch_dim, rope_theta)
        self.decoder = TransformerBlock(config=cfg, spec=transformer_layer_spec,
                                        post_layer_norm=False, pre_process=self.pre_process,
                                        post_process=self.post_process)
        self.ln_post = (VisionNorm(cfg.hidden_size, ln_post_eps or cfg.layernorm_epsilon,
                                   ln_post_kind or cfg.normalization, cfg.params_dtype)
                        if ln_post and post else None)
        self.head = AttentionPoolingHead(cfg) if pooling == "attention" and post else None
        self.merger = (PixtralLargePatchMerger(cfg, spatial_merge_size, merger_norm_eps)
                       if use_merger and post else None)
        tolerate_missing_extra_state(self)

    @property
    def patch_embedding(self) -> Optional[PatchEmbedding]:
        """The patch conv (None off the first pipeline stage), wherever ``patch_embed_path`` put it."""
        return self.get_submodule(self.patch_embed_path) if self.pre_process else None

    def _position(self, tokens: torch.Tensor, h_patches: int, w_patches: int) -> torch.Tensor:
        """(B, h·w, H) patch tokens -> (B, class_token_len + h·w, H) with class tokens and positions."""
        if self.class_token_len:
            cls = self.class_token.to(tokens.dtype).expand(tokens.shape[0], -1, -1)
            tokens = torch.cat([cls, tokens], dim=1)
        if self.pos_emb_type == "learned_absolute":
            tokens = tokens + self.position_embeddings(h_patches, w_patches).to(tokens.dtype)
        return tokens

    def _embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes]):
        """-> (tokens, or None off the first pipeline stage, rope, seqlens, grids).

        Grids, RoPE and sequence lengths follow from the input's shape alone, so every stage
        computes them; only the first stage owns the weights that embed the pixels.
        """
        device = pixel_values.device
        tokens = None
        if imgs_sizes is None:
            if pixel_values.dim() != 4:
                raise ValueError("static input must be images of shape (B, C, H, W); pass "
                                 "pre-patchified rows with imgs_sizes")
            check_image_size(pixel_values.shape[-2], pixel_values.shape[-1], self.patch_dim)
            h_patches, w_patches = (pixel_values.shape[-2] // self.patch_dim,
                                    pixel_values.shape[-1] // self.patch_dim)
            grids = [(h_patches, w_patches)] * pixel_values.shape[0]
            if self.pre_process:
                tokens, _, _ = self.patch_embedding(pixel_values)
                tokens = self._position(tokens, h_patches, w_patches)
            rope = (self.rotary_pos_emb(h_patches, w_patches, device)
                    if self.rotary_pos_emb is not None else None)
            seqlens = None
        else:
            grids, counts = _dynamic_patch_grid_lists(imgs_sizes, self.patch_dim)
            if pixel_values.dim() != 3 or pixel_values.shape[0] != 1:
                raise ValueError("dynamic input must be pre-patchified rows of shape (1, ΣN, C*P*P)")
            if pixel_values.shape[1] != sum(counts):
                raise ValueError(f"imgs_sizes describe {sum(counts)} patches but the input has "
                                 f"{pixel_values.shape[1]} rows")
            if self.pre_process:
                tokens = self.patch_embedding(pixel_values)
                if self.class_token_len or self.pos_emb_type == "learned_absolute":
                    parts = [self._position(t.unsqueeze(0), h, w)
                             for t, (h, w) in zip(tokens[0].split(counts), grids)]
                    tokens = torch.cat(parts, dim=1)
            rope = (_cat_rope([self.rotary_pos_emb(h, w, device) for h, w in grids])
                    if self.rotary_pos_emb is not None else None)
            seqlens = [self.class_token_len + n for n in counts]
        if self.ln_pre is not None:
            tokens = self.ln_pre(tokens)
        return tokens, rope, seqlens, grids

    def embed(self, pixel_values: torch.Tensor, imgs_sizes: Optional[ImageSizes] = None
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[list]]:
        """Embedding stage -> (tokens (B, N, H), rotary (N, 1, 1, d) or None, seqlens or None)."""
        tokens, rope, seqlens, _ = self._embed(pixel_values, imgs_sizes)
        return tokens, rope, seqlens

    def pool(self, hidden: torch.Tensor, seqlens: Optional[List[int]] = None) -> torch.Tensor:
        """Encoder output (B, N, H), or packed (1, ΣN, H) with ``seqlens`` -> (images, H)."""
        if self.pooling == "attention":
            return self.head(hidden, seqlens)
        if self.pooling == "class_token":
            if seqlens is None:
                pooled = hidden[:, 0]
            else:
                starts = torch.tensor([0, *seqlens[:-1]], device=hidden.device).cumsum(0)
                pooled = hidden[0].index_select(0, starts)
            return self.ln_post(pooled) if self.ln_post_scope == "pooled" else pooled
        raise ValueError("this ViTModel has no pooling configured")

    def forward(self, pixel_values: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                imgs_sizes: Optional[ImageSizes] = None, packed_seq_params=None,
                return_pooled: bool = False):
        """Returns the tokens (merged with ``use_merger``), or ``(tokens, pooled)`` with
        ``return_pooled`` (``pooled`` is None without a ``pooling``); pooling reads the encoder
        output, before any merger."""
        tokens, rope, seqlens, grids = self._embed(pixel_values, imgs_sizes)
        hidden = self.run_stack(tokens, rope, seqlens, attention_mask, packed_seq_params)
        if not self.post_process:
            return (hidden, None) if return_pooled else hidden
        if self.ln_post_scope == "tokens":
            hidden = self.ln_post(hidden)
        pooled = self.pool(hidden, seqlens) if return_pooled and self.pooling else None
        if self.merger is not None:
            hidden = (self.merger(hidden, grids=grids) if seqlens is not None
                      else self.merger(hidden, *grids[0]))
        return (hidden, pooled) if return_pooled else hidden
