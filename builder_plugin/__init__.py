"""builder_plugin: Phi-4-multimodal-instruct -> four-model ONNX Runtime GenAI package."""

__version__ = "0.1.0"
