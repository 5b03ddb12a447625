"""SigLIP vision encoder: CLIP's table with SigLIP's overrides.

The mcore side is the stock ``CLIPViTModel`` in its ``siglip`` configuration; the
attention-pooling head has no place there and is kept aside (side file) as ``head.*``.

No class token and no ``pre_layrnorm``; the patch conv has a bias; ``post_layernorm`` applies to
every token; with ``vision_use_head`` the attention-pooling head maps onto an mcore
``CrossAttention`` + ``MLP`` (see ``native.core.vit.AttentionPoolingHead``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmparity.models.clip import mapping as clip
from mmparity.mapping.blocks import linear_rules, normed_mlp_rules
from mmparity.mapping.ops import LayoutError, Op
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, TowerKeys, aside, rename
from mmparity.parallel.tp import cat
from mmparity.config import tower_config_or_self

FORMATS = ("hf",)
HF_PREFIXES = clip.HF_PREFIXES
DROP_HF = clip.DROP_HF


def _own(t: torch.Tensor) -> torch.Tensor:
    # Outputs never alias inputs: checkpoint writers refuse tensors that share storage.
    return t.contiguous().clone()


@dataclass(frozen=True, repr=False)
class SplitInProj(Op):
    """``nn.MultiheadAttention.in_proj_*`` rows ``[q; k; v]`` -> mcore ``CrossAttention``'s
    ``linear_q`` (q rows) and ``linear_kv`` (per head ``[k_h; v_h]``, so that a TP rank's contiguous
    row slice holds whole heads)."""

    num_heads: int
    head_dim: int
    n_mcore = 2

    def apply(self, hf):
        t = hf[0]
        size = self.num_heads * self.head_dim
        if t.shape[0] != 3 * size:
            raise LayoutError(f"{self!r}: in_proj leading dim must be {3 * size}, got {tuple(t.shape)}")
        q, k, v = torch.split(t, size, dim=0)
        rest = t.shape[1:]
        kv = cat([k.reshape(self.num_heads, 1, self.head_dim, *rest),
                  v.reshape(self.num_heads, 1, self.head_dim, *rest)], dim=1)
        return [_own(q), _own(kv.reshape(2 * size, *rest))]

    def invert(self, mcore):
        q, kv = mcore
        size = self.num_heads * self.head_dim
        if q.shape[0] != size or kv.shape[0] != 2 * size:
            raise LayoutError(f"{self!r}: expected linear_q / linear_kv leading dims {size} / "
                              f"{2 * size}, got {tuple(q.shape)} / {tuple(kv.shape)}")
        rest = q.shape[1:]
        pairs = kv.reshape(self.num_heads, 2, self.head_dim, *rest)
        k = pairs[:, 0].reshape(size, *rest)
        v = pairs[:, 1].reshape(size, *rest)
        return [_own(cat([q, k, v], dim=0))]

    def __repr__(self):
        return f"SplitInProj(heads={self.num_heads}, head_dim={self.head_dim})"


def head_rules(cfg) -> tuple:
    split = SplitInProj(cfg.num_attention_heads, clip.head_dim(cfg))
    hf, mc = "head.", "head."
    return (
        rename(mc + "probe", hf + "probe"),
        Rule((mc + "attention.linear_q.weight", mc + "attention.linear_kv.weight"),
             hf + "attention.in_proj_weight", split, "column"),
        Rule((mc + "attention.linear_q.bias", mc + "attention.linear_kv.bias"),
             hf + "attention.in_proj_bias", split, "column"),
        *linear_rules(mc + "attention.linear_proj", hf + "attention.out_proj", "row"),
        *normed_mlp_rules(mc + "mlp.", hf + "layernorm", hf + "mlp.fc1", hf + "mlp.fc2"),
    )


def rule_set(cfg, hf_format: str = "hf") -> RuleSet:
    cfg = tower_config_or_self(cfg, "siglip_vision_model")
    rules = (
        rename("conv1.weight", "embeddings.patch_embedding.weight"),
        rename("conv1.bias", "embeddings.patch_embedding.bias"),
        rename("position_embeddings.weight", "embeddings.position_embedding.weight"),
        *clip.encoder_layer_rules(cfg),
        rename("ln_post.weight", "post_layernorm.weight"),
        rename("ln_post.bias", "post_layernorm.bias"),
        *(aside(*head_rules(cfg)) if cfg.vision_use_head else ()),
    )
    return RuleSet(rules=rules, variables={"i": cfg.num_hidden_layers}, hf_prefixes=HF_PREFIXES,
                   drop_hf=DROP_HF, hf_format=hf_format,
                   validate_tp=lambda tp: clip.tp_problems(cfg, tp))


SPEC = ConverterSpec(formats=FORMATS, rule_set=rule_set,
                    tower=TowerKeys("siglip_vision_model", v4_checkpoint_root="vision_model."))
