"""Gemma3ForConditionalGeneration (model_type gemma3): Gemma3's text model with images.

transformers 5 on the same weights is the reference. One module a job:
- processor.py: image bytes -> the tower's pixels (transformers' Gemma3 image processor) and
  the tokens an `[img-N]` tag becomes (Gemma3Processor's);
- vision.py: SigLIP's vision tower and Gemma3's multimodal projector, and their config, over
  runner/models/vision_blocks.py;
- model.py: the adapter (`Gemma3Multimodal`: weight names, image features spliced into the
  text model, images attending both ways), and the registration, which importing this
  package does (runner/models/__init__.py).
"""

from runner.models.gemma3_vision.model import Gemma3Multimodal
from runner.models.gemma3_vision.processor import Gemma3ImagePreprocessor
from runner.models.gemma3_vision.vision import MultimodalProjector, VisionTower

__all__ = ["Gemma3ImagePreprocessor", "Gemma3Multimodal", "MultimodalProjector", "VisionTower"]
