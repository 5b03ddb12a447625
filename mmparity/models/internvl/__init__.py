"""The internvl family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.internvl.config import tower_output_refusal
from mmparity.models.record import FamilyRecord, Takes

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
