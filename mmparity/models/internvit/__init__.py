"""The internvit family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="InternViT vision encoder (InternVL's tower: class token, learned positions resampled "
            "for other sizes, LayerNorm or RMSNorm layers with layer scales, optional q/k norms "
            "over the whole width)",
    reference_classes=("InternVLVisionModel",),
    compared=("patch_embed", "pos_embed", "layers", "ln_post", "packed attention"),
    checkpoint_note="InternVLVisionModel, or the vision tower of a whole InternVL checkpoint (the "
                    "rest is dropped); the final layernorm (use_mean_pooling off) and a mask token "
                    "are kept beside the checkpoint",
    takes_whole=(Takes(architecture="InternVLVisionModel"), Takes(model_type="internvl_vision")),
    takes_part=(Takes(architecture="InternVLForConditionalGeneration", vision_model_type="internvl_vision"),
                Takes(model_type="internvl", vision_model_type="internvl_vision")),
)
