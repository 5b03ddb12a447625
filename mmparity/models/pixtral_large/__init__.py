"""The pixtral_large family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, MISTRAL_NATIVE, Takes

FAMILY = FamilyRecord(
    summary="Pixtral-Large / Mistral3 vision path: Pixtral tower, RMSNorm + 2x2 patch merger, "
            "MLP projector; static and packed mixed sizes",
    reference_classes=("PixtralVisionModel", "Mistral3MultiModalProjector"),
    compared=("patch_embed", "ln_pre", "layers", "merger_norm", "merger", "projector",
              "packed attention"),
    checkpoint_note="whole Mistral3ForConditionalGeneration checkpoint (vision tower + "
                    "multi_modal_projector, language model dropped), HF or Mistral-native "
                    "consolidated.safetensors layout",
    # Whole Mistral3 (and Mistral-native) releases are a whole-model family's, once there is one.
    takes_part=(Takes(architecture="Mistral3ForConditionalGeneration"), Takes(model_type="mistral3"),
                Takes(layout=MISTRAL_NATIVE, vision_model_type="pixtral")),
)
