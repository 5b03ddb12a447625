"""A throwaway whole VLM: LLaVA composed of a registered tower (CLIP) and the throwaway ``toy_moe``
language model. Its record; LLaVA's key tables serve it (``composed``)."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="a throwaway whole VLM (a test's): a CLIP tower, LLaVA's projector, the toy_moe decoder with experts",
    reference_classes=("LlavaForConditionalGeneration",),
    compared=("vision layers", "projector", "layers", "final_norm"),
    takes_whole=(Takes(architecture="LlavaForConditionalGeneration", text_model_type="toy_moe"),
                 Takes(model_type="llava", text_model_type="toy_moe")),
    composed=True,
)
