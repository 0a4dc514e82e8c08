"""The KV cache tensor names of one decoder layer, as onnxruntime-genai names them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayer:
    layer: int

    @property
    def past_key(self) -> str:
        return f"past_key_values.{self.layer}.key"

    @property
    def past_value(self) -> str:
        return f"past_key_values.{self.layer}.value"

    @property
    def present_key(self) -> str:
        return f"present.{self.layer}.key"

    @property
    def present_value(self) -> str:
        return f"present.{self.layer}.value"
