"""The pixtral_12b family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, MISTRAL_NATIVE, Takes

FAMILY = FamilyRecord(
    summary="Pixtral-12B: LLaVA with a Pixtral tower and a Mistral decoder, fed the Pixtral "
            "processor's [IMG] / [IMG_BREAK] / [IMG_END] rows; logits and per-token loss",
    reference_classes=("LlavaForConditionalGeneration",),
    compared=("vision layers", "projector", "language layers", "final_norm",
              "pixel_shuffle", "loss_weights", "expansion"),
    checkpoint_note="whole LlavaForConditionalGeneration checkpoint with a Pixtral tower and a "
                    "Mistral text model, as Megatron's LLaVAModel; HF or Mistral-native "
                    "(consolidated.safetensors + params.json)",
    takes_whole=(Takes(architecture="LlavaForConditionalGeneration", vision_model_type="pixtral",
                       text_model_type="mistral"),
                 Takes(model_type="llava", vision_model_type="pixtral", text_model_type="mistral"),
                 Takes(layout=MISTRAL_NATIVE, model_type="llava")),
    composed=True,
)
