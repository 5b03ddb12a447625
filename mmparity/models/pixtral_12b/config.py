"""What a release in Mistral's own layout of Pixtral-12B is in HF terms (its HF config.json is
LLaVA's, read with the llava package's table)."""

from __future__ import annotations

from mmparity.models.parts.mistral_params import NativeRelease

# A release in Mistral's layout (params.json beside consolidated.safetensors) is this model when
# its vision_encoder merges no patches, as transformers' conversion script decides: a LLaVA with a
# Pixtral tower and a Mistral text model.
MISTRAL_NATIVE = NativeRelease(merges_patches=False, model_type="llava", vision_model_type="pixtral",
                               text_model_type="mistral")
