"""The model architectures hybridd runs (Hugging Face `architectures` names).

Torch-free on purpose: the supervisor checks a model directory against it before it
spawns a worker (`hybridd.preflight`), and `hybridd.model.config` refuses the rest.
"""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
