"""Qwen3_5ForConditionalGeneration (model_type qwen3_5): Qwen3.5's text model with images,
the image side shared with Qwen3.5-MoE (runner/models/qwen3_5_moe.py).

transformers 5 on the same weights is the reference. One module a job:
- processor.py: image bytes -> the tower's patches (`smart_resize`, transformers' Qwen2-VL
  image processor) and the tokens an `[img-N]` tag becomes (Qwen3VLProcessor's);
- vision.py: the vision tower and patch merger (`VisionModel`) and its config, over
  runner/models/vision_blocks.py;
- positions.py: the text model's 3-channel rotary positions (mrope, `get_rope_index`);
- model.py: the adapter (`Qwen3_5ImageModel`), the checkpoint's split between text and tower,
  and the registration, which importing this package does (runner/models/__init__.py).
"""

from runner.models.qwen3_5_vision.model import Qwen3_5ImageModel, Qwen3_5Multimodal, VisionWeights
from runner.models.qwen3_5_vision.positions import MropeLayout, mrope_layout
from runner.models.qwen3_5_vision.processor import Qwen3_5ImagePreprocessor, smart_resize
from runner.models.qwen3_5_vision.vision import VisionModel

__all__ = [
    "MropeLayout",
    "Qwen3_5ImageModel",
    "Qwen3_5ImagePreprocessor",
    "Qwen3_5Multimodal",
    "VisionModel",
    "VisionWeights",
    "mrope_layout",
    "smart_resize",
]
