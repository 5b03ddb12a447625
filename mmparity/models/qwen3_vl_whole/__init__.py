"""The qwen3_vl_whole family: Qwen3-VL whole (its record in the registry: what ``mmparity list``
shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3-VL whole: the qwen3_vl tower with DeepStack + Qwen3 dense decoder (q/k RMSNorm "
            "per head, interleaved M-RoPE), DeepStack features added after the first decoder "
            "layers at the image tokens; logits and per-token loss",
    reference_classes=("Qwen3VLForConditionalGeneration",),
    compared=("vision layers", "deepstack mergers", "merger", "attention", "language layers",
              "final_norm"),
    checkpoint_note="whole Qwen3VLForConditionalGeneration checkpoint (model.visual.*, "
                    "model.language_model.*, lm_head) as Megatron's LLaVAModel tree "
                    "(vision_model with its mergers, language_model)",
    takes_whole=(Takes(architecture="Qwen3VLForConditionalGeneration"), Takes(model_type="qwen3_vl")),
)
