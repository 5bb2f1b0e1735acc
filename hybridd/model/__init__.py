"""The Llama-family model runtime: config, weights loader, paged KV cache, forward."""

from hybridd.model.config import ModelConfig
from hybridd.model.errors import ModelLoadError
from hybridd.model.kv_cache import KVCache
from hybridd.model.llama import LlamaModel
from hybridd.model.loader import load_model
from hybridd.model.step_inputs import StepInputs
from hybridd.model.tokenizer import load_tokenizer

__all__ = ["KVCache", "LlamaModel", "ModelConfig", "ModelLoadError", "StepInputs", "load_model", "load_tokenizer"]
