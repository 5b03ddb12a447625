"""The internvl family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes


def tower_output_refusal(cfg) -> str | None:
    """Why LLaVAModel cannot compute this InternVL: it reads its CLIPViTModel, which has no final
    norm, where transformers reads the tower's output (``vision_feature_layer`` -1) through one."""
    if cfg.vision_feature_layer == -1 and not cfg.vision_config.use_mean_pooling:
        return ("Megatron's LLaVAModel has no place for the tower's final LayerNorm, which InternVL "
                "applies to the features it reads (use_mean_pooling off, vision_feature_layer -1)")
    return None


FAMILY = FamilyRecord(
    summary="InternVL whole: InternViT tower, class token dropped, pixel shuffle, LayerNorm + MLP "
            "projector, Qwen2 / Llama decoder; images as tiles, each run of image tokens between "
            "<img> and </img>; logits and per-token loss",
    reference_classes=("InternVLForConditionalGeneration",),
    compared=("vision layers", "projector", "language layers", "final_norm", "pixel_shuffle",
              "loss_weights", "expansion"),
    checkpoint_note="whole InternVLForConditionalGeneration checkpoint as Megatron's LLaVAModel "
                    "(vision_model, vision_projection with its LayerNorm in linear_fc1, "
                    "language_model); vocabulary padded as Megatron-LM pads it",
    takes_whole=(Takes(architecture="InternVLForConditionalGeneration"), Takes(model_type="internvl")),
    composed=True,
    megatron_whole=lambda cfg: "" if tower_output_refusal(cfg) else "LLaVAModel",
)
