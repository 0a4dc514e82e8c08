"""`python -m builder_plugin.verify PACKAGE --checkpoint CKPT`: does a built package match the checkpoint it came from?

modes.py (what is checked) -> prompts.py (the cases per mode) -> engine.py (onnxruntime-genai, as an app runs it) ->
`builder_plugin.reference.streaming` (the checkpoint in PyTorch, read on its own, layer by layer, teacher-forced on
the tokens the package generated) -> metrics.py (logit agreement, the thresholds per precision and the verdict per
mode) -> report.py (Markdown and JSON). package_info.py reads the package's precision and decoder shape. No builder
code runs on either side: the yardstick must not share the builder's mistakes.
"""
