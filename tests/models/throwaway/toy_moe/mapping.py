"""Key tables: DeepSeek-V3's (its layouts, expert rules and TP checks)."""

from mmparity.models.parts.deepseek_v3.mapping import SPEC  # noqa: F401
