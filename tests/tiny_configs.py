"""The tiny model configuration the caches, fidelity and sampling tests build their random models
from (``dctms.toolkit.tiny_model.write_tiny_model``), kept once: a family's overrides go on top."""

from __future__ import annotations

BASE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 257,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "eos_token_id": 256,
}

# The overrides of the plain float32 Qwen2 (tied embeddings) every one of them starts from.
QWEN2_F32 = {"model_type": "qwen2", "torch_dtype": "float32", "tie_word_embeddings": True}
