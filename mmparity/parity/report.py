"""Report dataclasses and their JSON form. Rendering for people lives in the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Divergence:
    module: str
    metrics: dict
    tolerance: dict

    def as_dict(self) -> dict:
        return {"module": self.module, "metrics": self.metrics, "tolerance": self.tolerance}


@dataclass
class Result:
    family: str
    check: str
    passed: bool
    metrics: dict
    tolerance: dict
    first_divergence: Optional[Divergence] = None
    description: str = ""
    modules: list = field(default_factory=list)  # per paired module: {"module", "metrics", "passed"}
    impl: str = "native"  # whose model produced it: "native" (mmparity's) or "megatron" (Megatron's own)

    def as_dict(self) -> dict:
        return {
            "family": self.family,
            "check": self.check,
            "passed": self.passed,
            "metrics": self.metrics,
            "tolerance": self.tolerance,
            "first_divergence": self.first_divergence.as_dict() if self.first_divergence else None,
            "description": self.description,
            "modules": self.modules,
            "impl": self.impl,
        }


@dataclass
class Report:
    device: str
    dtype: str
    seed: int
    attention_backend: str
    results: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    impl: str = "native"
    # With Megatron's class under test: its version, which TE modules ran, the class.
    megatron: Optional[dict] = None

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def failures(self) -> list:
        return [r for r in self.results if not r.passed]

    def as_dict(self) -> dict:
        return {
            "versions": self.versions,
            "device": self.device,
            "dtype": self.dtype,
            "seed": self.seed,
            "tp": self.tp,
            "pp": self.pp,
            "attention_backend": self.attention_backend,
            "passed": self.passed,
            "impl": self.impl,
            **({"megatron": self.megatron} if self.megatron is not None else {}),
            "results": [r.as_dict() for r in self.results],
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.as_dict(), indent=indent, allow_nan=True)


def versions() -> dict:
    from importlib import metadata

    import mmparity

    out = {"mmparity": mmparity.__version__}
    for dist, key in (("torch", "torch"), ("transformers", "transformers"),
                      ("megatron-core", "megatron-core")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out
