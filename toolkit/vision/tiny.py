"""Tiny vision-language model folders with random weights, as mlx-vlm would load them.

Used by the tests and ``dctms bench vlm``: nothing is downloaded. A folder holds ``config.json``,
``model.safetensors`` (mlx-vlm's own model class, built from the config), a byte-level
``tokenizer.json`` with the family's image special tokens, and the processor configs the
family's processor reads (transformers' image processor for the family, the chat-free prompt
expansion of mlx-vlm's processor).
"""

from __future__ import annotations

import json
from pathlib import Path

from dctms.schema.errors import DctmsError

# Special tokens after the 256 byte tokens, per family: (token, role).
_SPECIALS = {
    "gemma3": ["<eos>", "<bos>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "qwen2_vl": [
        "<|endoftext|>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<|video_pad|>",
    ],
}

MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]


def gemma3_config(image_size: int = 32, patch: int = 8, tokens_per_image: int = 4) -> dict:
    """A small gemma3 (SigLIP tower, fixed resolution): every image becomes ``tokens_per_image``
    soft tokens after the tower's average pooling."""
    vocab = 256 + len(_SPECIALS["gemma3"])
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": 259,
        "pad_token_id": 0,
        "eos_token_id": 256,
        "vocab_size": vocab,
        "hidden_size": 64,
        "torch_dtype": "float32",
        "mm_tokens_per_image": tokens_per_image,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "vocab_size": vocab,
            "sliding_window": 4096,
            "sliding_window_pattern": 1,
            "mm_tokens_per_image": tokens_per_image,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": patch,
            "image_size": image_size,
        },
    }


def qwen2_vl_config() -> dict:
    """A small qwen2_vl (dynamic resolution: the image size decides the patch count; images are
    rounded to multiples of 28 by its processor)."""
    vocab = 256 + len(_SPECIALS["qwen2_vl"])
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "image_token_id": 258,
        "video_token_id": 260,
        "vision_start_token_id": 257,
        "vision_end_token_id": 259,
        "eos_token_id": 256,
        "vocab_size": vocab,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "text_config": {
            "model_type": "qwen2_vl",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        },
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }


CONFIGS = {"gemma3": gemma3_config, "qwen2_vl": qwen2_vl_config}


def write_tiny_vlm(folder: Path, family: str, seed: int = 0, **options) -> Path:
    """Create ``folder`` holding a tiny random ``family`` VLM that mlx-vlm loads and runs."""
    if family not in CONFIGS:
        raise DctmsError(f"no tiny VLM for {family!r}; families: {', '.join(CONFIGS)}")
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = CONFIGS[family](**options)
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(
        model_config, arch, config, ["text", "vision", "perceiver", "projector", "audio"]
    )
    model = arch.Model(model_config)
    # Random projections everywhere (mlx's default init leaves some ones/zeros that make a tiny
    # model ignore its image): a normal of small spread for every floating parameter but norms.
    # The projector gets a wider spread and the (tied) embedding a narrow one, so the image
    # tokens weigh more than the last token's own embedding (a tied head repeats it otherwise).
    params = []
    for k, v in tree_flatten(model.parameters()):
        if "norm" in k or v.ndim < 2:
            params.append((k, v))
        else:
            spread = 1.0 if "projector" in k or "merger" in k else 0.2
            spread = 0.02 if "embed_tokens" in k else spread
            params.append((k, mx.random.normal(v.shape, dtype=v.dtype) * spread))
    model.update(tree_unflatten(params))
    weights = dict(tree_flatten(model.parameters()))
    if family == "gemma3":
        # Gemma 3 ties its head to the embedding: mlx-vlm's loader always sets lm_head from
        # embed_tokens (LanguageModel.sanitize), so the folder holds them equal.
        weights["language_model.lm_head.weight"] = weights[
            "language_model.model.embed_tokens.weight"
        ]
    mx.eval(list(weights.values()))
    tmp = folder / "model.safetensors.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_tokenizer(folder, family)
    _write_processor(folder, family, config)
    return folder


def _write_tokenizer(folder: Path, family: str) -> None:
    from tokenizers import AddedToken, Tokenizer

    from dctms.toolkit.tiny_model import write_byte_tokenizer

    path = folder / "tokenizer.json"
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True) for t in _SPECIALS[family]])
    tok.save(str(path))
    specials = _SPECIALS[family]
    cfg: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    if family == "gemma3":
        cfg.update(
            eos_token=specials[0],
            bos_token=specials[1],
            pad_token=specials[0],
            extra_special_tokens={
                "boi_token": specials[2],
                "image_token": specials[3],
                "eoi_token": specials[4],
            },
        )
    else:
        cfg.update(eos_token=specials[0], pad_token=specials[0])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _write_processor(folder: Path, family: str, config: dict) -> None:
    if family == "gemma3":
        size = config["vision_config"]["image_size"]
        pre = {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": size, "width": size},
            "resample": 2,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": MEAN,
            "image_std": STD,
            "do_convert_rgb": True,
            "do_pan_and_scan": False,
        }
        proc = {
            "processor_class": "Gemma3Processor",
            "image_seq_length": config["mm_tokens_per_image"],
        }
    else:
        pre = {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": MEAN,
            "image_std": STD,
            "do_convert_rgb": True,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1280,
        }
        proc = {"processor_class": "Qwen2VLProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (folder / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
