"""The kimi_k25 family: its record in the registry (what ``mmparity list`` shows and which
checkpoints detection gives it); its modules sit beside this file."""

from mmparity.models.record import FamilyRecord, Takes

FAMILY = FamilyRecord(
    summary="Kimi-K2.5 MoonViT (bicubic learned positions, interleaved 2D RoPE, LayerNorm, 2x2 "
            "merger with temporal mean) and projector; static, packed mixed sizes, video clips",
    reference_classes=("Kimi_K25VisionModel", "Kimi_K25MultimodalProjection"),
    compared=("patch_embed", "pos_embed", "rope2d", "layers", "final_layernorm", "merger",
              "projector", "packed attention"),
    checkpoint_note="HF layout (Kimi_K25VisionModel, or a whole Kimi_K25ForConditionalGeneration "
                    "checkpoint: tower + mm_projector, language model dropped) or the original "
                    "release layout (encoder.blocks.N.wqkv …, mm_projector.proj.* or Kimi-VL's "
                    "multi_modal_projector.*)",
    takes_whole=(Takes(architecture="Kimi_K25VisionModel"), Takes(model_type="kimi_k25_vision")),
    takes_part=(Takes(architecture="Kimi_K25ForConditionalGeneration"), Takes(model_type="kimi_k25")),
)
