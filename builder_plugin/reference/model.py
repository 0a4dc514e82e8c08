"""The reference model: transformers' native ``Phi4MultimodalForCausalLM`` in fp32 on eager attention, with the LoRA
of each input mode merged in from one pristine copy of the base weights, and greedy decoding as prefill plus one-token
KV-cached steps (the incremental forward onnxruntime-genai matches), never ``generate()``, which drops the cache at the
LongRoPE boundary."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM
from transformers.cache_utils import DynamicCache

from builder_plugin.layout import MODE_LORA, mode_of
from builder_plugin.reference.checkpoint import LoraAdapter, merge_lora, open_checkpoint
from builder_plugin.reference.errors import ReferenceModelError
from builder_plugin.reference.features import (
    as_tensor,
    count_image_tokens,
    encode_audio,
    encode_images,
    encode_inputs,
    scatter_features,
)
from builder_plugin.reference.keys import LORA_TARGET

LORA_MODES = tuple(MODE_LORA.values())  # "none" and the adapters


@dataclass
class GreedyResult:
    tokens: list[int]  # new tokens only
    step_logits: list[torch.Tensor]  # [vocab] fp32 per step; [0] = last position of the prefill
    top2_gap: list[float]  # top-1 minus top-2 logit per step, to spot near-ties
    lora: str  # "none" | "vision" | "speech"
    projection: str | None  # audio projection pair used ("speech" | "vision"), None without audio
    prompt_length: int = 0
    inputs_embeds: torch.Tensor | None = field(default=None, repr=False)  # [1, S, hidden] prefill embeddings


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


class Reference:
    """Native transformers Phi-4-multimodal in fp32 with eager attention, plus per-mode LoRA merging."""

    def __init__(
        self,
        model: Phi4MultimodalForCausalLM,
        base_weights: dict[str, torch.Tensor],
        adapters: dict[str, LoraAdapter],
        source_format: str,
    ) -> None:
        self.model = model
        self.config: Phi4MultimodalConfig = model.config
        self.adapters = adapters
        self.source_format = source_format
        self._base_weights = base_weights  # pristine, stored dtype; merges always start from these
        self._active_lora = "none"

    # ---- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> Reference:
        checkpoint = open_checkpoint(Path(checkpoint_dir))
        with torch.device("meta"):
            checkpoint.check(Phi4MultimodalForCausalLM(checkpoint.config))
        state = {name: tensor.load() for name, tensor in checkpoint.tensors.items()}
        model = cls._build_model(checkpoint.config, state)
        targets = sorted(name for name, _ in model.named_parameters()
                         if LORA_TARGET.fullmatch(name.removesuffix(".weight")))
        adapters = {name: adapter.loaded() for name, adapter in checkpoint.adapters.items()}
        return cls(model, {name: state[name] for name in targets}, adapters, checkpoint.source_format)

    @staticmethod
    def _build_model(config: Phi4MultimodalConfig, state: dict[str, torch.Tensor]) -> Phi4MultimodalForCausalLM:
        # Build on the meta device (no random init), then assign the checkpoint tensors upcast to fp32.
        with torch.device("meta"):
            model = Phi4MultimodalForCausalLM(config)
        # copy=True: the model must never alias the pristine tensors that LoRA merges start from.
        fp32_state = {key: value.to(torch.float32, copy=True) for key, value in state.items()}
        result = model.load_state_dict(fp32_state, strict=False, assign=True)
        missing = [key for key in result.missing_keys if not (key == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or result.unexpected_keys:
            raise ReferenceModelError(
                f"checkpoint does not match the native model: {len(missing)} missing {missing[:8]}, "
                f"{len(result.unexpected_keys)} unexpected {result.unexpected_keys[:8]}"
            )
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # The rotary buffers are not persistent, so nothing above filled them.
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        still_meta = [name for name, t in tensors if t.is_meta]
        if still_meta:
            raise ReferenceModelError(f"tensors left uninitialised after loading: {still_meta[:8]}")
        not_fp32 = [name for name, t in tensors if t.is_floating_point() and t.dtype != torch.float32]
        if not_fp32:
            raise ReferenceModelError(f"tensors not in fp32 after loading: {not_fp32[:8]}")
        model.eval()
        not_eager = [
            type(m).__name__
            for m in model.modules()
            if getattr(getattr(m, "config", None), "_attn_implementation", "eager") != "eager"
        ]
        if not_eager:
            raise ReferenceModelError(f"modules not on eager attention: {sorted(set(not_eager))}")
        return model

    # ---- LoRA ---------------------------------------------------------------------------------------------------

    def set_lora(self, lora: str) -> None:
        """Make the decoder weights base (``"none"``) or base + the named adapter, rebuilt from the pristine copy."""
        lora = "none" if lora in ("none", "text", None) else lora
        if lora not in LORA_MODES:
            raise ReferenceModelError(f"unknown LoRA mode {lora!r}; expected one of {LORA_MODES}")
        if lora == self._active_lora:
            return
        if lora != "none" and lora not in self.adapters:
            raise ReferenceModelError(f"checkpoint has no {lora} LoRA adapter (has {sorted(self.adapters)})")
        adapter = self.adapters.get(lora)
        with torch.no_grad():
            for name, base in self._base_weights.items():
                param = self.model.get_parameter(name)
                pair = adapter.weights.get(name.removesuffix(".weight")) if adapter else None
                if pair is None:
                    param.copy_(base.to(torch.float32))
                else:
                    param.copy_(merge_lora(base, *pair, adapter.scaling))
        self._active_lora = lora

    @property
    def active_lora(self) -> str:
        return self._active_lora

    @staticmethod
    def mode_for(has_image: bool, has_audio: bool) -> str:
        """Input mode -> "text" | "vision" | "speech" (which LoRA the original model activates)."""
        return mode_of(has_image, has_audio)

    @staticmethod
    def lora_for_mode(mode: str) -> str:
        return MODE_LORA[mode]

    # ---- features -----------------------------------------------------------------------------------------------

    def num_image_tokens(self, image_attention_mask: Any, image_sizes: Any) -> list[int]:
        """Feature rows per image, from the HD canvas size and the crop masks (see `count_image_tokens`)."""
        return count_image_tokens(self.config.vision_config, image_attention_mask, image_sizes)

    def image_features(self, pixel_values: Any, image_attention_mask: Any, image_sizes: Any) -> torch.Tensor:
        """[sum of image tokens, hidden] fp32, after the projection MLP, images in order."""
        return encode_images(self.model.model.embed_tokens_extend.image_embed, self.config, pixel_values,
                             image_attention_mask, image_sizes)

    def audio_features(
        self, audio_embeds: Any, audio_attention_mask: Any, audio_sizes: Any, projection: str
    ) -> torch.Tensor:
        """[sum(audio_sizes), hidden] fp32; each clip encoded alone on its valid frames, then projected."""
        return encode_audio(self.model.model.embed_tokens_extend.audio_embed, self.config, audio_embeds,
                            audio_attention_mask, audio_sizes, projection)

    @torch.no_grad()
    def embeddings(
        self,
        input_ids: Any,
        image_features: torch.Tensor | None = None,
        audio_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image rows scattered over the image placeholders and audio rows over the audio ones."""
        ids = as_tensor(input_ids, torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        return scatter_features(self.config, ids, self.model.model.embed_tokens(ids), image_features, audio_features)

    # ---- decoder ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, inputs_embeds: torch.Tensor, lora: str, last_n: int | None = None) -> torch.Tensor:
        """Full-sequence forward without cache: [B, S, vocab] fp32 (or the last ``last_n`` positions)."""
        self.set_lora(lora)
        embeds = inputs_embeds if inputs_embeds.dim() == 3 else inputs_embeds[None]
        out = self.model(inputs_embeds=embeds.to(torch.float32), use_cache=False, logits_to_keep=last_n or 0)
        return out.logits

    def _step(self, embeds: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(inputs_embeds=embeds, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].clone()

    def _token_embedding(self, token: int) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor([[token]], dtype=torch.long))

    @torch.no_grad()
    def decode_logits(
        self, inputs_embeds_prefix: torch.Tensor, new_token_ids: Iterable[int], lora: str
    ) -> list[torch.Tensor]:
        """Prefill on the embeddings, then feed ``new_token_ids`` one at a time through the KV cache.

        Returns the last-position logits [vocab] after the prefill and after each fed token (1 + len(tokens) items).
        """
        self.set_lora(lora)
        embeds = inputs_embeds_prefix if inputs_embeds_prefix.dim() == 3 else inputs_embeds_prefix[None]
        cache = DynamicCache(config=self.config)
        steps = [self._step(embeds.to(torch.float32), cache)]
        for token in new_token_ids:
            steps.append(self._step(self._token_embedding(int(token)), cache))
        return steps

    @torch.no_grad()
    def prefill_and_greedy(
        self,
        inputs: Mapping[str, Any],
        max_new_tokens: int,
        lora: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        recompute_at_switch: bool = False,
    ) -> GreedyResult:
        """Greedy generation from the tensors onnxruntime-genai's MultiModalProcessor produces.

        The LoRA (unless given) and the audio projection follow the input mode as in the original model. Decoding
        runs exactly ``max_new_tokens`` steps unless ``eos_token_ids`` is given, in which case it stops after the
        first of them is emitted. With ``recompute_at_switch`` the loop behaves like the original model's
        generation: when the sequence first reaches ``original_max_position_embeddings + 1`` tokens on a cache of at
        most that many, the cache is dropped and every position runs again (with the long LongRoPE factors).
        """
        if max_new_tokens < 1:
            raise ReferenceModelError("max_new_tokens must be at least 1")
        extend = self.model.model.embed_tokens_extend
        ids, image_features, audio_features, projection = encode_inputs(
            extend.image_embed, extend.audio_embed, self.config, inputs
        )
        has_image, has_audio = image_features is not None, audio_features is not None
        embeds = self.embeddings(ids, image_features, audio_features)

        chosen = lora if lora is not None else self.lora_for_mode(self.mode_for(has_image, has_audio))
        self.set_lora(chosen)
        stop = {int(t) for t in eos_token_ids} if eos_token_ids is not None else set()
        switch = self.config.original_max_position_embeddings
        cache = DynamicCache(config=self.config)
        step_logits = [self._step(embeds, cache)]
        tokens: list[int] = []
        while True:
            token = int(torch.argmax(step_logits[-1]))
            tokens.append(token)
            if len(tokens) >= max_new_tokens or token in stop:
                break
            length = embeds.shape[1] + len(tokens)
            if recompute_at_switch and length >= switch + 1 and cache.get_seq_length() <= switch:
                cache = DynamicCache(config=self.config)
                generated = torch.cat([self._token_embedding(t) for t in tokens], dim=1)
                step_logits.append(self._step(torch.cat([embeds, generated], dim=1), cache))
                continue
            step_logits.append(self._step(self._token_embedding(token), cache))
        return GreedyResult(
            tokens=tokens,
            step_logits=step_logits,
            top2_gap=[_top2_gap(step) for step in step_logits],
            lora=self._active_lora,
            projection=projection,
            prompt_length=int(ids.shape[1]),
            inputs_embeds=embeds,
        )
