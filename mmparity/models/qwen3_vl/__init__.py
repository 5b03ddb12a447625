"""The qwen3_vl family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Qwen3-VL vision tower with DeepStack: Qwen3.5-MoE's tower plus one post-shuffle merger "
            "per deepstack_visual_indexes layer, static and packed mixed sizes",
    reference_classes=("Qwen3VLVisionModel",),
    compared=("patch_embed", "pos_embed", "rope2d", "block_first", "layers", "deepstack mergers",
              "merger", "packed attention"),
    checkpoint_note="standalone vision tower, or a whole Qwen3VLForConditionalGeneration "
                    "checkpoint (model.visual.*) whose language model is dropped",
    takes_whole=(Takes(architecture="Qwen3VLVisionModel"), Takes(model_type="qwen3_vl_vision")),
    takes_part=(Takes(architecture="Qwen3VLForConditionalGeneration"), Takes(model_type="qwen3_vl")),
)
