"""The reference in bounded memory: the same native modules as `Reference`, never held whole, for checkpoints of any
size (verify runs it on the full-size model).

The vision and speech encoders (well under 1 B parameters each) are built whole from the native classes, one after
the other, and dropped. The text decoder is built a layer at a time: a native ``Phi4MultimodalDecoderLayer`` from
that layer's checkpoint tensors, the LoRA of each input mode merged in (`merge_lora`, as `Reference` does), run over
every position of each teacher-forced sequence (prompt + the tokens the package generated) with a causal mask and the
native LongRoPE; only the hidden states [T, hidden] survive it. Token rows and the lm_head are read in row ranges.

Semantics per input mode, as the original model: text -> no LoRA, any image -> vision LoRA, audio only -> speech
LoRA; the audio projection is the vision pair iff an image is present; each clip encoded alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Phi4MultimodalForCausalLM
from transformers.models.phi4_multimodal.modeling_phi4_multimodal import (
    Phi4MultimodalAudioEmbedding,
    Phi4MultimodalDecoderLayer,
    Phi4MultimodalImageEmbedding,
    Phi4MultimodalRMSNorm,
    Phi4MultimodalRotaryEmbedding,
)

from builder_plugin.layout import INPUT_IDS, MODE_LORA, mode_of
from builder_plugin.reference.checkpoint import StoredTensor, merge_lora, open_checkpoint
from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.features import encode_audio, encode_images, scatter_features

LORA_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
IMAGE_EMBED = "model.embed_tokens_extend.image_embed."
AUDIO_EMBED = "model.embed_tokens_extend.audio_embed."
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


class StreamingReference:
    """Teacher-forced logits of a checkpoint, one decoder layer in memory at a time."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.checkpoint = open_checkpoint(Path(checkpoint_dir))
        self.config = self.checkpoint.config
        with torch.device("meta"):  # names and shapes only: a broken checkpoint fails before anything runs
            self.checkpoint.check(Phi4MultimodalForCausalLM(self.config))
        tensors = self.checkpoint.tensors
        self.token_table: StoredTensor = tensors["model.embed_tokens.weight"]
        self.lm_head = self.token_table if self.config.tie_word_embeddings else tensors["lm_head.weight"]

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
            image_embed = self._encoder(Phi4MultimodalImageEmbedding, IMAGE_EMBED)
            for i in progress(with_images, "reference: vision encoder"):
                inputs = sequences[i].inputs
                image_rows[i] = encode_images(image_embed, self.config, inputs["pixel_values"],
                                              inputs["image_attention_mask"], inputs["image_sizes"])
            del image_embed
        audio_rows: dict[int, torch.Tensor] = {}
        with_audio = [i for i, s in enumerate(sequences) if s.has_audio]
        if with_audio:
            audio_embed = self._encoder(Phi4MultimodalAudioEmbedding, AUDIO_EMBED)
            for i in progress(with_audio, "reference: speech encoder"):
                s = sequences[i]
                audio_rows[i] = encode_audio(audio_embed, self.config, s.inputs["audio_embeds"],
                                             s.inputs.get("audio_attention_mask"), s.inputs["audio_sizes"],
                                             s.projection)
            del audio_embed
        out = []
        for i, s in enumerate(sequences):
            ids = self._teacher_forced_ids(s)
            out.append(scatter_features(self.config, ids, self._token_rows(ids), image_rows.get(i), audio_rows.get(i)))
        return out

    def decoder(self, embeds: list[torch.Tensor], sequences: Sequence[TeacherForced],
                progress: Progress = _no_progress) -> list[torch.Tensor]:
        """The final-norm hidden states [len(tokens), hidden] of the generated positions, layer by layer."""
        prompt_lengths = [int(s.inputs[INPUT_IDS].shape[-1]) for s in sequences]
        rotary = Phi4MultimodalRotaryEmbedding(self.config)
        positions = [_incremental_rotary(rotary, e, n) for e, n in zip(embeds, prompt_lengths)]
        masks = [_causal_mask(e.shape[1], self.config.sliding_window) for e in embeds]
        by_lora: dict[str, list[int]] = {}
        for i, s in enumerate(sequences):
            by_lora.setdefault(s.lora, []).append(i)
        hidden = list(embeds)
        for index in progress(range(self.config.num_hidden_layers), "reference: decoder layers"):
            layer, base = self._decoder_layer(index)
            for lora, members in by_lora.items():
                self._set_lora(layer, index, base, lora)
                for i in members:
                    hidden[i] = layer(hidden[i], attention_mask=masks[i], position_embeddings=positions[i])
            del layer, base
        norm = Phi4MultimodalRMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight = torch.nn.Parameter(self._fp32("model.norm.weight"), requires_grad=False)
        return [norm(h[0, n - 1 : n - 1 + len(s.tokens)]) for h, n, s in zip(hidden, prompt_lengths, sequences)]

    def project(self, hidden: list[torch.Tensor], progress: Progress = _no_progress) -> list[np.ndarray]:
        """The lm_head over the hidden rows, reading the token table in row chunks."""
        rows = torch.cat(hidden)
        vocab = self.lm_head.shape[0]
        logits = torch.empty(rows.shape[0], vocab, dtype=torch.float32)
        for start in progress(range(0, vocab, LM_HEAD_ROWS), "reference: lm_head"):
            stop = min(start + LM_HEAD_ROWS, vocab)
            logits[:, start:stop] = rows @ self.lm_head.rows(start, stop).float().T
        return [part.numpy() for part in torch.split(logits, [h.shape[0] for h in hidden])]

    # ---- weights --------------------------------------------------------------------------------------------------

    def _fp32(self, name: str) -> torch.Tensor:
        return self.checkpoint.tensors[name].load().to(torch.float32)

    def _state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor under `prefix`, named relative to it, in fp32."""
        return {name.removeprefix(prefix): self._fp32(name) for name in self.checkpoint.tensors
                if name.startswith(prefix)}

    def _encoder(self, module_class: type[torch.nn.Module], prefix: str) -> torch.nn.Module:
        with torch.device("meta"):
            module = module_class(self.config)
        _assign(module, self._state(prefix), module_class.__name__)
        return module.eval()

    def _decoder_layer(self, index: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        state = self._state(f"model.layers.{index}.")
        with torch.device("meta"):
            layer = Phi4MultimodalDecoderLayer(self.config, index)
        _assign(layer, state, f"decoder layer {index}")
        base = {proj: state[f"{proj}.weight"] for proj in LORA_PROJECTIONS}
        return layer.eval(), base

    def _set_lora(self, layer: torch.nn.Module, index: int, base: dict[str, torch.Tensor], lora: str) -> None:
        adapter = None if lora == "none" else self.checkpoint.adapters.get(lora)
        if lora != "none" and adapter is None:
            raise ReferenceModelError(f"the checkpoint has no {lora} LoRA adapter "
                                      f"(has {sorted(self.checkpoint.adapters)})")
        for proj, weight in base.items():
            if adapter is not None:
                weight = merge_lora(weight, *adapter.pair(f"model.layers.{index}.{proj}"), adapter.scaling)
            layer.get_submodule(proj).weight = torch.nn.Parameter(weight, requires_grad=False)

    def _teacher_forced_ids(self, sequence: TeacherForced) -> torch.Tensor:
        """[1, T]: the prompt, then every generated token but the last (nothing is predicted after it)."""
        prompt = torch.from_numpy(np.asarray(sequence.inputs[INPUT_IDS], dtype=np.int64).reshape(1, -1))
        fed = torch.tensor([list(sequence.tokens)[:-1]], dtype=torch.long).reshape(1, -1)
        return torch.cat([prompt, fed], dim=1)

    def _token_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] fp32 token embeddings, reading only the distinct rows the sequence uses."""
        unique, inverse = torch.unique(ids[0], return_inverse=True)
        table = torch.cat([self.token_table.rows(int(t), int(t) + 1) for t in unique]).float()
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
