"""Reference side of Pixtral-Large: a Mistral3 model's vision tower and multimodal projector.

The family's HF unit is a whole ``Mistral3ForConditionalGeneration`` checkpoint; only what the
vision path needs is built (``PixtralVisionModel`` + ``Mistral3MultiModalProjector``), under the
attribute names ``Mistral3Model`` uses, so a whole checkpoint's ``vision_tower.*`` and
``multi_modal_projector.*`` tensors load as they are and the language model is never built.
The run follows ``Mistral3Model.get_image_features``: the tower's hidden state at
``vision_feature_layer``, then the projector (RMSNorm with the *text* config's epsilon, the 2x2
patch merger, linear_1 -> act -> linear_2).
"""

from __future__ import annotations

import torch
from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig, PixtralVisionModel
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, tokens_2d
from mmparity.reference import pixtral

MODEL_TYPES = ("mistral3",)
OUTPUTS = ("merger", "projector")


def tiny_config() -> Mistral3Config:
    """Tiny Mistral3: Pixtral tower of 4 heads x 12, text hidden 40 (TP 2 and 4 divide both), a
    text ``rms_norm_eps`` far from the tower's 1e-5 so that taking the wrong epsilon shows, and
    projector biases on."""
    vision = PixtralVisionConfig(hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                                 num_attention_heads=4, image_size=64, patch_size=8,
                                 hidden_act="silu", num_channels=3)
    text = MistralConfig(hidden_size=40, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=20, vocab_size=64,
                         rms_norm_eps=1e-3)
    return Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                          projector_hidden_act="gelu", multimodal_projector_bias=True,
                          vision_feature_layer=-1)


def vision_config(cfg):
    """The family config is the whole Mistral3 config (the projector needs the text config)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Mistral3 "
                     "(Pixtral-Large) model")


class Mistral3VisionReference(torch.nn.Module):
    """``vision_tower`` + ``multi_modal_projector`` of ``Mistral3Model``, nothing else."""

    def __init__(self, cfg: Mistral3Config):
        super().__init__()
        if getattr(cfg.vision_config, "model_type", None) != "pixtral":
            raise ValueError(f"Mistral3 vision tower of model_type "
                             f"{getattr(cfg.vision_config, 'model_type', None)!r} is not Pixtral")
        self.config = cfg
        self.vision_tower = PixtralVisionModel(cfg.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(cfg)


def build(cfg) -> Mistral3VisionReference:
    return Mistral3VisionReference(vision_config(cfg)).eval()


def patch_size(cfg) -> int:
    return pixtral.patch_size(cfg.vision_config)


def image_size_problems(cfg, sizes) -> list[str]:
    """The merger needs at least one whole merge block per image (HF drops odd edge rows/cols)."""
    p, m = patch_size(cfg), cfg.spatial_merge_size
    return [f"image size {h}x{w} gives a {h // p}x{w // p} patch grid, smaller than one "
            f"{m}x{m} merge block (need at least {m * p}x{m * p} pixels)"
            for h, w in sizes if h // p < m or w // p < m]


def default_image_sizes(cfg) -> list[tuple[int, int]]:
    """Odd grids (the merger drops their last row / column, as ``F.unfold`` does), non-square."""
    p = patch_size(cfg)
    return [(5 * p, 7 * p), (4 * p, 6 * p), (7 * p, 2 * p)]


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    cfg = vision_config(cfg)
    sizes = list(image_sizes or default_image_sizes(cfg))
    channels = cfg.vision_config.num_channels
    imgs = inputs.images(sizes, channels, seed)
    out = [Case("packed", {"images": imgs, "sizes": sizes}, OUTPUTS,
                description=f"{len(sizes)} images {', '.join(f'{h}x{w}' for h, w in sizes)} in one "
                            "packed pass, merged per image")]
    static_sizes = [sizes[0]] * 2
    static_imgs = inputs.images(static_sizes, channels, seed + 1)
    out.append(Case("static", {"images": static_imgs, "sizes": static_sizes}, OUTPUTS,
                    description=f"static batch of 2 images {static_sizes[0][0]}x{static_sizes[0][1]}"))
    return out


def prepare_case(case: Case, cfg) -> Case:
    case.data.setdefault("patch", patch_size(cfg))
    return case


def run(model: Mistral3VisionReference, case: Case) -> dict:
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    batch, sizes = inputs.pad_batch(case.data["images"])
    image_sizes = torch.tensor(sizes)
    out = model.vision_tower(batch.to(device, dtype), image_sizes=image_sizes,
                             output_hidden_states=True)
    layer = model.config.vision_feature_layer
    if not isinstance(layer, int):
        raise NotImplementedError("several vision_feature_layer values are not supported")
    features = out.hidden_states[layer]
    seen = {}
    handle = model.multi_modal_projector.patch_merger.register_forward_hook(
        lambda module, args, output: seen.__setitem__("merger", output))
    try:
        projected = model.multi_modal_projector(features.squeeze(0), image_sizes)
    finally:
        handle.remove()
    return {"merger": seen["merger"], "projector": projected}


def pairs(model: Mistral3VisionReference, cfg) -> list[Pair]:
    proj = model.multi_modal_projector
    return pixtral.pairs(model.vision_tower, cfg.vision_config) + [
        Pair("merger_norm", proj.norm, tokens_2d),
        Pair("merger", proj.patch_merger, tokens_2d),
        Pair("projector", proj, tokens_2d),
    ]


COMPONENTS = ("merger",)
# Grids of the merger component (the native side uses the same): one odd (last row / column
# dropped), one even.
MERGER_GRIDS = (inputs.COMPONENT_GRID, (4, 6))


def merger_probe(hidden: int, seed: int) -> torch.Tensor:
    """Seeded packed tokens (ΣN, hidden) for the images of :data:`MERGER_GRIDS`."""
    n = sum(h * w for h, w in MERGER_GRIDS)
    return torch.randn(n, hidden, generator=inputs.generator(seed + 104729))


def component(name: str, model: Mistral3VisionReference, cfg, seed: int) -> torch.Tensor:
    if name == "merger":
        merger = model.multi_modal_projector.patch_merger
        p = patch_size(cfg)
        tokens = merger_probe(cfg.vision_config.hidden_size, seed)
        sizes = torch.tensor([(h * p, w * p) for h, w in MERGER_GRIDS])
        return merger(inputs.like_model(tokens, model), sizes)
    raise KeyError(name)
