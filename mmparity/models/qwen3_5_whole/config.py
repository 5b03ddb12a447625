"""The HF configuration classes of whole dense Qwen3.5 as config.json is read without transformers
(``mmparity.config``'s ConfigView): transformers 5's defaults of ``Qwen3_5Config`` and
``Qwen3_5VisionConfig``. Qwen3.5-MoE's whole and vision tables sit with the qwen3_5 tower family,
the dense text model's with the qwen3_5_text part; the vision classes differ only in name."""

from __future__ import annotations

from mmparity.config import ConfigType, renamed_sub
from mmparity.models.qwen3_5.config import HF_CONFIGS as TOWER_CONFIGS

HF_CONFIGS = {
    "qwen3_5": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 248056,
                           "video_token_id": 248057, "vision_start_token_id": 248053,
                           "vision_end_token_id": 248054, "tie_word_embeddings": False},
                          subs={"vision_config": ("qwen3_5_vision", False, {}),
                                "text_config": ("qwen3_5_text", False, {})},
                          before=renamed_sub("vision_config", "qwen3_5", "qwen3_5_vision")),
    "qwen3_5_vision": TOWER_CONFIGS["qwen3_5_moe_vision"],
}
