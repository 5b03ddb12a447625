"""The llama4_vision family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Llama 4 vision encoder (unfolded-patch linear, class token last, learned positions, 2D "
            "RoPE, LayerNorm+GELU layers, pixel shuffle + MLP adapter), fixed-size tiles",
    reference_classes=("Llama4VisionModel",),
    compared=("patch_embed", "ln_pre", "layers", "ln_post", "adapter"),
    checkpoint_note="Llama4VisionModel, or the vision_model.* of a whole Llama 4 checkpoint (the rest "
                    "is dropped)",
    takes_whole=(Takes(architecture="Llama4VisionModel"), Takes(model_type="llama4_vision_model")),
    takes_part=(Takes(architecture="Llama4ForConditionalGeneration", vision_model_type="llama4_vision_model"),
                Takes(model_type="llama4", vision_model_type="llama4_vision_model")),
)
