"""The qwen3_5_whole family: Qwen3.5 and Qwen3.5-MoE whole (its record in the registry: what
``mmparity list`` shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3.5 / Qwen3.5-MoE whole: the qwen3_5 tower and merger + the qwen3_5_text hybrid "
            "decoder (Gated DeltaNet + gated attention, dense or routed experts) with interleaved "
            "M-RoPE over image grids; logits and per-token loss",
    # Both classes in one name: the two in full do not fit the list's 80 columns.
    reference_classes=("Qwen3_5[Moe]ForConditionalGeneration",),
    compared=("vision layers", "merger", "self_attention (DeltaNet and attention)", "mlp", "router",
              "language layers", "final_norm"),
    checkpoint_note="whole Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration "
                    "checkpoint (model.visual.*, model.language_model.*, lm_head) as Megatron's "
                    "LLaVAModel tree (vision_model, language_model); mtp.* left out and listed",
    takes_whole=(Takes(architecture="Qwen3_5ForConditionalGeneration"),
                 Takes(architecture="Qwen3_5MoeForConditionalGeneration"),
                 Takes(model_type="qwen3_5"), Takes(model_type="qwen3_5_moe")),
    with_language=True,
    low_memory=False,
)
