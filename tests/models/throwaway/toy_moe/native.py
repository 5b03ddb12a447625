"""Native side: DeepSeek-V3's mcore decoder (MLA, routed and shared experts), unchanged."""

from mmparity.models.parts.deepseek_v3.native import (  # noqa: F401
    LanguageModelBuilder, config_problems, mlp_pairs, transformer_config)
