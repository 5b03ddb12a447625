"""What Gemma 3's and Gemma 4's decoder configs share: the two layer types and the checks of a
config's layer list and each type's RoPE. Config only: no framework is imported."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_type_problems(text, rope_types: tuple[str, ...]) -> list[str]:
    """What of ``text``'s ``layer_types`` and per-type ``rope_parameters`` a Gemma decoder cannot
    reproduce: a type other than sliding / full, a list that does not name every layer, a RoPE
    type outside ``rope_types``."""
    problems = []
    unknown = sorted(set(text.layer_types) - {SLIDING, FULL})
    if unknown:
        problems.append(f"text_config: layer_types {unknown} (sliding_attention and full_attention only)")
    if len(text.layer_types) != text.num_hidden_layers:
        problems.append(f"text_config: {len(text.layer_types)} layer_types for {text.num_hidden_layers} layers")
    for kind in sorted(set(text.layer_types) & {SLIDING, FULL}):
        rope = (text.rope_parameters or {}).get(kind) or {}
        if rope.get("rope_type", "default") not in rope_types:
            problems.append(f"text_config: {kind} rope_type {rope.get('rope_type')!r} "
                            f"({' and '.join(rope_types)} only)")
    return problems
