"""The checkpoint side: transformers' native Phi-4-multimodal modules in fp32, run in bounded memory.

The vision and speech encoders (well under 1 B parameters each) are built whole from the native classes, one after
the other, and dropped. The text decoder is never held whole: each layer is built as a native
``Phi4MultimodalDecoderLayer`` from that layer's checkpoint tensors (read through the project's CheckpointReader and
routing table, so both checkpoint layouts work), the LoRA of each input mode merged in as ``W + (alpha / r) B A``, and
run over every position of each teacher-forced sequence (prompt + the tokens the package generated) with a causal
mask and the native LongRoPE; only the hidden states [T, hidden] survive it. Token rows and the lm_head are read in
row ranges.

Semantics per input mode, as the original model: text -> no LoRA, any image -> vision LoRA,
audio only -> speech LoRA; the audio projection is the vision pair iff an image is present; each clip encoded alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Phi4MultimodalConfig
from transformers.models.phi4_multimodal.modeling_phi4_multimodal import (
    Phi4MultimodalAudioEmbedding,
    Phi4MultimodalDecoderLayer,
    Phi4MultimodalImageEmbedding,
    Phi4MultimodalRMSNorm,
    Phi4MultimodalRotaryEmbedding,
)

from builder_plugin.checkpoint.reader import CheckpointReader, TensorRef
from builder_plugin.checkpoint.routing import AUDIO_EMBED, IMAGE_EMBED, ignored_prefixes, route_weights
from builder_plugin.config import Phi4MMConfig
from builder_plugin.layout import INPUT_IDS, MODE_LORA, mode_of
from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.features import encode_audio, encode_images, scatter_features
from builder_plugin.reference.native_config import native_config_from_dict, native_config_from_original
from builder_plugin.spec import Component

LORA_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
LM_HEAD_ROWS = 16384  # rows of the token table per lm_head chunk: 200 MB in fp32 at the real hidden size

Progress = Callable[[Sequence[object], str], Sequence[object]]


@dataclass(frozen=True)
class TeacherForced:
    """One teacher-forced sequence: the processor tensors of the prompt and the tokens generated after it."""

    inputs: Mapping[str, np.ndarray]
    tokens: Sequence[int]

    @property
    def has_image(self) -> bool:
        return "pixel_values" in self.inputs and self.inputs["pixel_values"].shape[0] > 0

    @property
    def has_audio(self) -> bool:
        return "audio_embeds" in self.inputs and self.inputs["audio_embeds"].shape[0] > 0

    @property
    def lora(self) -> str:
        return MODE_LORA[mode_of(self.has_image, self.has_audio)]

    @property
    def projection(self) -> str | None:
        return ("vision" if self.has_image else "speech") if self.has_audio else None


def _no_progress(items: Sequence[object], _: str) -> Sequence[object]:
    return items


def native_config(config: Phi4MMConfig) -> Phi4MultimodalConfig:
    """The transformers-native config of a checkpoint of either layout, on eager attention (sdpa makes the native
    SigLIP causal)."""
    if config.source_format == "original":
        native = native_config_from_original(config.raw)
    else:
        native = native_config_from_dict(config.raw)
    native._attn_implementation = "eager"
    return native


class StreamingReference:
    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.config = Phi4MMConfig.from_dir(checkpoint_dir)
        self.reader = CheckpointReader(checkpoint_dir, self.config.source_format)
        self.weights = route_weights(self.reader, self.config)
        self.native = native_config(self.config)
        decoder = self.weights[Component.DECODER]
        self.token_table: TensorRef = decoder["embed_tokens.weight"]
        self.lm_head: TensorRef = decoder.get("lm_head.weight", self.token_table)

    # ---- public ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, sequences: Sequence[TeacherForced], progress: Progress = _no_progress) -> list[np.ndarray]:
        """[len(tokens), vocab] fp32 per sequence: the logits at the last prompt position and after each generated
        token but the last, i.e. the distributions each generated token was chosen from."""
        embeds = self.input_embeddings(sequences, progress)
        hidden = self.decoder(embeds, sequences, progress)
        return self.project(hidden, progress)

    # ---- stages ---------------------------------------------------------------------------------------------------

    def input_embeddings(self, sequences: Sequence[TeacherForced],
                         progress: Progress = _no_progress) -> list[torch.Tensor]:
        """[1, T, hidden] per sequence: token rows with the image and audio features over their placeholders."""
        image_rows: dict[int, torch.Tensor] = {}
        with_images = [i for i, s in enumerate(sequences) if s.has_image]
        if with_images:
            image_embed = self._encoder(Phi4MultimodalImageEmbedding, Component.VISION, IMAGE_EMBED)
            for i in progress(with_images, "reference: vision encoder"):
                inputs = sequences[i].inputs
                image_rows[i] = encode_images(image_embed, self.native, inputs["pixel_values"],
                                              inputs["image_attention_mask"], inputs["image_sizes"])
            del image_embed
        audio_rows: dict[int, torch.Tensor] = {}
        with_audio = [i for i, s in enumerate(sequences) if s.has_audio]
        if with_audio:
            audio_embed = self._encoder(Phi4MultimodalAudioEmbedding, Component.SPEECH, AUDIO_EMBED)
            for i in progress(with_audio, "reference: speech encoder"):
                s = sequences[i]
                audio_rows[i] = encode_audio(audio_embed, self.native, s.inputs["audio_embeds"],
                                             s.inputs.get("audio_attention_mask"), s.inputs["audio_sizes"],
                                             s.projection)
            del audio_embed
        out = []
        for i, s in enumerate(sequences):
            ids = self._teacher_forced_ids(s)
            out.append(scatter_features(self.native, ids, self._token_rows(ids), image_rows.get(i), audio_rows.get(i)))
        return out

    def decoder(self, embeds: list[torch.Tensor], sequences: Sequence[TeacherForced],
                progress: Progress = _no_progress) -> list[torch.Tensor]:
        """The final-norm hidden states [len(tokens), hidden] of the generated positions, layer by layer."""
        prompt_lengths = [int(s.inputs[INPUT_IDS].shape[-1]) for s in sequences]
        rotary = Phi4MultimodalRotaryEmbedding(self.native)
        positions = [_incremental_rotary(rotary, e, n) for e, n in zip(embeds, prompt_lengths)]
        masks = [_causal_mask(e.shape[1], self.native.sliding_window) for e in embeds]
        by_lora: dict[str, list[int]] = {}
        for i, s in enumerate(sequences):
            by_lora.setdefault(s.lora, []).append(i)
        hidden = list(embeds)
        for index in progress(range(self.config.text.num_hidden_layers), "reference: decoder layers"):
            layer, base = self._decoder_layer(index)
            for lora, members in by_lora.items():
                self._set_lora(layer, index, base, lora)
                for i in members:
                    hidden[i] = layer(hidden[i], attention_mask=masks[i], position_embeddings=positions[i])
            del layer, base
        norm = Phi4MultimodalRMSNorm(self.config.text.hidden_size, eps=self.config.text.rms_norm_eps)
        norm.weight = torch.nn.Parameter(self.weights[Component.DECODER]["norm.weight"].load(), requires_grad=False)
        return [norm(h[0, n - 1 : n - 1 + len(s.tokens)]) for h, n, s in zip(hidden, prompt_lengths, sequences)]

    def project(self, hidden: list[torch.Tensor], progress: Progress = _no_progress) -> list[np.ndarray]:
        """The lm_head over the hidden rows, reading the token table in row chunks."""
        rows = torch.cat(hidden)
        vocab = self.lm_head.shape[0]
        logits = torch.empty(rows.shape[0], vocab, dtype=torch.float32)
        for start in progress(range(0, vocab, LM_HEAD_ROWS), "reference: lm_head"):
            stop = min(start + LM_HEAD_ROWS, vocab)
            logits[:, start:stop] = rows @ self.lm_head.load_rows(start, stop).T
        return [part.numpy() for part in torch.split(logits, [h.shape[0] for h in hidden])]

    # ---- weights --------------------------------------------------------------------------------------------------

    def _encoder(self, module_class: type[torch.nn.Module], component: Component, prefix: str) -> torch.nn.Module:
        """A native encoder module with the routed weights of `component`, plus the checkpoint tensors the graphs
        leave out but the native module still runs (SigLIP's last layer, post-layernorm and pooling head)."""
        state = {local: ref.load() for local, ref in self.weights[component].items()}
        for pattern, _ in ignored_prefixes(self.config):
            if pattern.startswith(prefix):
                for name, ref in self.reader.items():
                    if name == pattern or (pattern.endswith(".") and name.startswith(pattern)):
                        state[name.removeprefix(prefix)] = ref.load()
        with torch.device("meta"):
            module = module_class(self.native)
        _assign(module, state, module_class.__name__)
        return module.eval()

    def _decoder_layer(self, index: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        prefix = f"layers.{index}."
        state = {
            local.removeprefix(prefix): ref.load()
            for local, ref in self.weights[Component.DECODER].items()
            if local.startswith(prefix) and ".lora_" not in local
        }
        with torch.device("meta"):
            layer = Phi4MultimodalDecoderLayer(self.native, index)
        _assign(layer, state, f"decoder layer {index}")
        base = {proj: state[f"{proj}.weight"] for proj in LORA_PROJECTIONS}
        return layer.eval(), base

    def _set_lora(self, layer: torch.nn.Module, index: int, base: dict[str, torch.Tensor], lora: str) -> None:
        decoder = self.weights[Component.DECODER]
        if lora != "none" and lora not in self.config.loras:
            raise ReferenceModelError(f"the checkpoint has no {lora} LoRA adapter (has {sorted(self.config.loras)})")
        for proj, weight in base.items():
            if lora != "none":
                a = decoder[f"layers.{index}.{proj}.lora_A.{lora}.weight"].load()
                b = decoder[f"layers.{index}.{proj}.lora_B.{lora}.weight"].load()
                weight = torch.addmm(weight, b, a, alpha=self.config.loras[lora].scaling)
            layer.get_submodule(proj).weight = torch.nn.Parameter(weight, requires_grad=False)

    def _teacher_forced_ids(self, sequence: TeacherForced) -> torch.Tensor:
        """[1, T]: the prompt, then every generated token but the last (nothing is predicted after it)."""
        prompt = torch.from_numpy(np.asarray(sequence.inputs[INPUT_IDS], dtype=np.int64).reshape(1, -1))
        fed = torch.tensor([list(sequence.tokens)[:-1]], dtype=torch.long).reshape(1, -1)
        return torch.cat([prompt, fed], dim=1)

    def _token_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] fp32 token embeddings, reading only the distinct rows the sequence uses."""
        unique, inverse = torch.unique(ids[0], return_inverse=True)
        table = torch.stack([self.token_table.load_rows(int(t), int(t) + 1)[0] for t in unique])
        return table[inverse][None]


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    result = module.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ReferenceModelError(
            f"checkpoint does not match the native {what}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    still_meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ReferenceModelError(f"{what}: tensors left uninitialised: {still_meta[:5]}")


def _causal_mask(length: int, sliding_window: int | None) -> torch.Tensor:
    """[1, 1, T, T] additive mask: position i sees j <= i (and i - j < window with a sliding window), as the native
    create_causal_mask / create_sliding_window_causal_mask."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= (i - j) < sliding_window
    mask = torch.zeros(length, length, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def _incremental_rotary(rotary: Phi4MultimodalRotaryEmbedding, embeds: torch.Tensor,
                        prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [1, T, rotary dim] as a prefill of the prompt plus one-token steps gives them: LongRoPE picks its
    factor set from the length seen so far, so a step past original_max_position_embeddings switches to the long
    factors while the prompt keeps the short ones (what the KV-cached runtime does)."""
    length = embeds.shape[1]
    positions = torch.arange(length)[None]
    parts = [rotary(embeds, positions[:, :prompt_length])]
    parts += [rotary(embeds, positions[:, p : p + 1]) for p in range(prompt_length, length)]
    return torch.cat([c for c, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1)
