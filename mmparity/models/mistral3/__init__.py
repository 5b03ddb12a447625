"""The mistral3 family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, MISTRAL_NATIVE, Takes

FAMILY = FamilyRecord(
    summary="Mistral3 whole (Mistral-Small-3.1 / Pixtral-Large style): Pixtral tower with the "
            "2x2 merger, MLP projector, Mistral decoder; Pixtral processor's image rows; logits "
            "and per-token loss",
    reference_classes=("Mistral3ForConditionalGeneration",),
    compared=("vision layers", "merger", "projector", "language layers", "final_norm",
              "pixel_shuffle", "loss_weights", "expansion"),
    checkpoint_note="whole Mistral3ForConditionalGeneration checkpoint as Megatron's LLaVAModel "
                    "(vision_model with merger, vision_projection, language_model), HF or "
                    "Mistral-native (consolidated.safetensors + params.json); vocabulary padded as "
                    "Megatron-LM pads it",
    takes_whole=(Takes(architecture="Mistral3ForConditionalGeneration"), Takes(model_type="mistral3"),
                 Takes(layout=MISTRAL_NATIVE, model_type="mistral3")),
    composed=True,
)
