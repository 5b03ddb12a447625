"""The model a conversion reads and writes: its family's spec, looked up once per command, its
config, read once, and its rule tables, each built once.

The disk layer is handed a :class:`Model` (``io.formats.base.Model`` says what it reads of one):
it never resolves a family by name, and nothing in a conversion builds the same table twice.
"""

from __future__ import annotations

import torch

from mmparity.mapping import rules as R

__all__ = ["Model"]


class Model:
    """One family's model for one conversion: its ``spec``, its config (the family's part of the
    HF config, and the config file's bytes as they are written beside an mcore checkpoint) and its
    rule tables by HF layout, each built on first use and kept."""

    def __init__(self, spec, cfg, config_bytes: bytes):
        self.spec, self.cfg, self.config_bytes = spec, cfg, config_bytes
        self.name = spec.name
        self.formats = tuple(spec.converter.formats)
        self._rules: dict[str, R.RuleSet] = {}

    def rules(self, hf_format: str | None = None, keys=None) -> R.RuleSet:
        """The table for ``hf_format`` (None: the family's default; with ``keys``, the layout those
        keys are in). A table told from a checkpoint's keys is kept for its layout only where it is
        the default's (a table read through transformers' mapping depends on the keys it read)."""
        if keys is None:
            fmt = hf_format or self.formats[0]
            table = self._rules.get(fmt)
            if table is None:
                table = self._rules[fmt] = self.spec.rule_set(self.cfg, fmt)
            return table
        table = self.spec.rule_set(self.cfg, hf_format, keys=keys)
        if table.hf_format == self.formats[0]:
            self._rules.setdefault(table.hf_format, table)
        return table

    @property
    def recorded_args(self) -> dict:
        """Megatron-LM arguments its family (and, for a whole VLM, its language model) declares
        beyond what the config's common fields and the tensors tell."""
        facts = _declared(self.spec, self.cfg)
        if self.spec.composed or self.spec.with_language:
            from mmparity.models import registry

            try:
                facts.update(_declared(registry.language_of(self.cfg), self.cfg.text_config))
            except ValueError:  # no registered language model: nothing more to say
                pass
        return facts

    def expected_shapes(self, tp: int = 1, vocab_multiple: int = R.VOCAB_MULTIPLE, part: str = "") -> dict | None:
        """mcore shapes the HF config implies: the reference model's state-dict shapes (read off the
        config, so no model is imported), converted by the default table (``part``: that part's
        keys, without its root).

        The rule engine only sees shapes an op needs (q/k/v, gate/up); a renamed tensor of the wrong
        size (a norm, a position table) would otherwise pass. None when the config's shapes do not
        convert (then the op checks are all there is).
        """
        try:
            # Shape records, not meta tensors: a whole model's worth made while the source's plan is
            # held, at the conversion's planning peak.
            dtype = torch.get_default_dtype()
            state = {key: R.shared_meta(dtype, shape) for key, shape in self.spec.state_shapes(self.cfg).items()}
            outputs = R.plan_hf_to_mcore(self.rules(), state, tp, prefix="", vocab_multiple=vocab_multiple).outputs
        except Exception:
            return None
        # A part's keys are the whole model's under its root, without it.
        return {key[len(part):]: t.shape for key, t in outputs.items() if key.startswith(part)}


def _declared(record, cfg) -> dict:
    """A family's or part's Megatron-LM arguments for ``cfg`` (its own config): the fixed ones,
    then those its config tells."""
    facts = dict(record.megatron_args)
    if record.megatron_config_args is not None:
        facts.update(record.megatron_config_args(cfg))
    return facts
