"""The size of a package's KV cache: bytes per position, from its genai_config and build options.

The runtime allocates a generator's cache for its whole length up front: keys and values of every layer, in the
decoder's I/O dtype (float32 for fp32 builds and CPU int4/int8 builds, float16 otherwise)."""

from __future__ import annotations

from typing import Any

from builder_plugin.precisions import io_dtype

FLOAT32_BYTES, FLOAT16_BYTES = 4, 2


def kv_bytes_per_token(genai_config: dict[str, Any], builder: dict[str, Any] | None) -> int:
    """Bytes of KV cache per position. `builder` is the manifest's record of the build (None for older packages:
    the dtype then follows the providers the decoder's session lists, none meaning the CPU)."""
    decoder = genai_config["model"]["decoder"]
    values = int(decoder["num_hidden_layers"]) * 2 * int(decoder["num_key_value_heads"]) * int(decoder["head_size"])
    return values * _element_bytes(decoder, (builder or {}).get("options") or {})


def _element_bytes(decoder: dict[str, Any], options: dict[str, Any]) -> int:
    precision, provider = options.get("precision"), options.get("execution_provider")
    if precision is None or provider is None:
        listed = decoder.get("session_options", {}).get("provider_options") or []
        provider = next((name for entry in listed for name in entry), "cpu")
        precision = precision or "int4"
    return FLOAT32_BYTES if io_dtype(precision, provider) == "float32" else FLOAT16_BYTES
