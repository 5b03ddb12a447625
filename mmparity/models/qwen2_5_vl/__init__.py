"""The qwen2_5_vl family: the Qwen2.5-VL vision tower (its record in the registry: what ``mmparity
list`` shows and which checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen2.5-VL vision tower: RMSNorm blocks with a gated SiLU MLP, 2D RoPE, window "
            "attention (full attention in fullatt_block_indexes), RMSNorm 2x2 merger",
    reference_classes=("Qwen2_5_VisionTransformerPretrainedModel",),
    compared=("layers", "window attention", "merger", "packed mixed sizes"),
    checkpoint_note="standalone vision tower, or a whole Qwen2_5_VLForConditionalGeneration "
                    "checkpoint (model.visual.*) whose language model is dropped",
    takes_whole=(Takes(architecture="Qwen2_5_VisionTransformerPretrainedModel"),
                 Takes(model_type="qwen2_5_vl_vision")),
    takes_part=(Takes(architecture="Qwen2_5_VLForConditionalGeneration"), Takes(model_type="qwen2_5_vl")),
)
