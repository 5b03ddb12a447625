"""The llava family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

# Vision towers stock LLaVAModel builds (its CLIPViTModel); a Pixtral one it cannot (ViTModel).
LLAVA_MODEL_TOWERS = {"clip_vision_model": True, "siglip_vision_model": True}

FAMILY = FamilyRecord(
    summary="LLaVA: a registered vision tower (Pixtral, CLIP, SigLIP; vision_feature_layer, "
            "select strategy), MLP projector, Llama-style GPT decoder; logits and per-token loss",
    reference_classes=("LlavaForConditionalGeneration",),
    compared=("pixel_shuffle", "loss_weights", "expansion", "vision layers", "projector",
              "layers", "final_norm"),
    checkpoint_note="whole LlavaForConditionalGeneration checkpoint (module names, or files "
                    "saved by transformers 5 or 4); vocabulary padded to a multiple of 128 "
                    "for TP and trimmed on export; tied or untied lm_head",
    takes_whole=(Takes(architecture="LlavaForConditionalGeneration"), Takes(model_type="llava")),
    composed=True,
    megatron_whole=lambda cfg: "LLaVAModel" if LLAVA_MODEL_TOWERS.get(
        getattr(getattr(cfg, "vision_config", None), "model_type", None)) else "",
)


def tower_takes(vision_model_type: str) -> tuple:
    """What a tower family takes part of: a LLaVA checkpoint whose vision tower is of
    ``vision_model_type`` (its ``takes_part``)."""
    return (Takes(architecture="LlavaForConditionalGeneration", vision_model_type=vision_model_type),
            Takes(model_type="llava", vision_model_type=vision_model_type))
