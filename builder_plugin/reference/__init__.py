"""Independent PyTorch reference for Phi-4-multimodal: the yardstick the ONNX graphs are measured against, by the tests
and by ``python -m builder_plugin.verify``.

Everything numeric here comes from transformers' native ``Phi4MultimodalForCausalLM`` (eager attention, fp32). This
package must never import ``builder_plugin`` code outside itself but the package's names (``builder_plugin.layout``:
the placeholder ids and the input-mode rule the runtime shares): it reads checkpoints, converts configs and merges LoRA
on its own. Semantics reproduced from the original ``Phi4MMForCausalLM``:

- LoRA per input mode: text only -> none, any image -> vision adapter, audio only -> speech adapter; merged into the
  text decoder weights as ``W + (alpha / r) * B @ A`` from one pristine copy of the base weights.
- Audio projection: the ``*_vision_speech`` pair iff an image is present, else the ``*_for_speech`` pair; clips encoded
  one at a time on their valid frames.
- Decoding is prefill plus one-token KV-cached steps, never ``generate()``.

Modules: `native_config` (config.json -> Phi4MultimodalConfig), `keys` (original -> native tensor names),
`checkpoint` (a folder's tensors and adapters, read on demand; the native model's names and shapes checked; the LoRA
merge), `features` (encoders and the placeholder scatter), `model` (`Reference`: the whole model in memory, LoRA
merging, logits, greedy decoding), `streaming` (`StreamingReference`: the same modules a decoder layer at a time,
teacher-forced, for checkpoints of any size: verify's yardstick), `errors`.
"""
