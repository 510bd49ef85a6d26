"""minfer.convert: Hugging Face safetensors checkpoints → GGUF (`minfer convert`)."""

from minfer.convert.convert import OUTTYPES, convert_hf

__all__ = ["OUTTYPES", "convert_hf"]
