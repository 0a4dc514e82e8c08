"""`python -m builder_plugin.verify PACKAGE --checkpoint CKPT`: does a built package match the checkpoint it came from?

prompts.py (the cases per input mode) -> engine.py (onnxruntime-genai, as an app runs it) -> reference.py (the
checkpoint in PyTorch, layer by layer, teacher-forced on the tokens the package generated) -> metrics.py (logit
agreement and the verdict per mode, thresholds per precision from precision.py) -> report.py (Markdown and JSON).
"""
