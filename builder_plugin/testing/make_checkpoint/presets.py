"""The checkpoint sizes the generator knows (tiny for tests, full for the released shapes; each also "-outliers",
with the outliers of real checkpoints planted: outliers.py) and their rope factors."""

from __future__ import annotations

from builder_plugin.testing.make_checkpoint.outliers import Outliers

# Long-RoPE long factors of the released checkpoint (48 = 128 head dims * 0.75 / 2).
REAL_LONG_FACTORS = (
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)  # fmt: skip

PRESETS: dict[str, dict] = {
    "full": {
        "text": {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
        },
        "vision": None,  # img_processor null: the hard-coded SigLIP-so400m
        "audio": {
            "attention_dim": 1024,
            "attention_heads": 16,
            "num_blocks": 24,
            "linear_units": 1536,
            "conv_channels": 1024,
            "ext_pw_out_channel": 1024,
            "depthwise_seperable_out_channel": 1024,
        },
        "vision_lora": {"r": 256, "lora_alpha": 512},
        "speech_lora": {"r": 320, "lora_alpha": 640},
        "num_shards": None,  # at most 1.5 GiB per shard
    },
    "tiny": {
        "text": {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,  # head_dim 64: the smallest that ORT GQA's fused rotary accepts with 0.75
            "num_key_value_heads": 2,
            "max_position_embeddings": 16384,
            "original_max_position_embeddings": 128,
        },
        "vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4},
        "audio": {
            "attention_dim": 64,
            "attention_heads": 4,
            "num_blocks": 2,
            "linear_units": 96,
            "conv_channels": 32,
            "ext_pw_out_channel": 64,
            "depthwise_seperable_out_channel": 64,
        },
        "vision_lora": {"r": 8, "lora_alpha": 16},  # scaling 2.0
        "speech_lora": {"r": 12, "lora_alpha": 36},  # scaling 3.0, unlike vision, so a swapped scale shows
        "num_shards": 2,
    },
}


for _size in ("tiny", "full"):
    PRESETS[f"{_size}-outliers"] = {**PRESETS[_size], "outliers": Outliers()}


def long_rope_factors(count: int) -> tuple[list[float], list[float]]:
    """(short, long) factors. With the real count the real values; otherwise a resampled copy of the real curve."""
    if count == len(REAL_LONG_FACTORS):
        return [1.0] * count, [float(x) for x in REAL_LONG_FACTORS]
    last = len(REAL_LONG_FACTORS) - 1
    long = []
    for i in range(count):
        pos = i * last / max(count - 1, 1)
        lo = min(int(pos), last - 1)
        frac = pos - lo
        long.append(round(REAL_LONG_FACTORS[lo] * (1 - frac) + REAL_LONG_FACTORS[lo + 1] * frac, 6))
    # Slightly non-uniform short factors, so a builder that ignores them gives different rotary angles.
    short = [round(1.0 + 0.05 * i / max(count - 1, 1), 6) for i in range(count)]
    return short, long


def positive(value: int, what: str) -> int:
    if int(value) < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return int(value)
