"""The qwen2_5_vl_whole family: Qwen2.5-VL whole (its record in the registry: what ``mmparity list``
shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen2.5-VL whole: the qwen2_5_vl tower (window attention) + Qwen2 decoder (q/k/v "
            "biases, M-RoPE in contiguous t/h/w sections); logits and per-token loss",
    reference_classes=("Qwen2_5_VLForConditionalGeneration",),
    compared=("vision layers", "merger", "attention", "language layers", "final_norm"),
    checkpoint_note="whole Qwen2_5_VLForConditionalGeneration checkpoint (model.visual.*, "
                    "model.language_model.*, lm_head) as Megatron's LLaVAModel tree "
                    "(vision_model with its merger, language_model)",
    takes_whole=(Takes(architecture="Qwen2_5_VLForConditionalGeneration"), Takes(model_type="qwen2_5_vl")),
)
