"""Checkpoint folders in the Hugging Face Mixtral format.

A folder holds `config.json` (`MixtralForCausalLM`), `model.safetensors` (HF parameter names,
e.g. `model.layers.0.block_sparse_moe.experts.3.w1.weight`), `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json`, so the same folder loads in our model,
in `transformers` and in vLLM. Every malformed or mismatched piece is refused with a
`CheckpointError` (a `ValueError`) naming the file and the field or tensor.

Called by bootstrap, the engines, the learner and the weight store.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from core.files import atomic_path, atomic_write
from serving.model import ModelArgs, Transformer

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ModelArgs field <- config.json key
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "n_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
    "pad_id": "pad_token_id",
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used; the message names the file and the field."""


def hf_name(name: str) -> str:
    """Our parameter name -> the HF Mixtral checkpoint name."""
    return name if name.startswith("lm_head.") else "model." + name


def args_to_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    cfg = {key: getattr(args, field) for field, key in _CONFIG_KEYS.items()}
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    cfg.update(
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "sliding_window": None,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "router_aux_loss_coef": 0.0,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "use_cache": True,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
    )
    return cfg


def config_to_args(cfg: dict, path: Path) -> tuple[ModelArgs, torch.dtype]:
    where = path / CONFIG
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or "MixtralForCausalLM" not in archs:
        raise CheckpointError(f"{where}: field 'architectures' must list MixtralForCausalLM, got {archs!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: field 'hidden_act' must be 'silu', got {cfg['hidden_act']!r}")
    values = {}
    for field, key in _CONFIG_KEYS.items():
        if key not in cfg:
            if key == "rope_theta" and isinstance(cfg.get("rope_parameters"), dict):
                values[field] = cfg["rope_parameters"].get("rope_theta")
                continue
            if key in ("pad_token_id", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
                continue  # optional: ModelArgs defaults apply
            raise CheckpointError(f"{where}: missing field {key!r}")
        values[field] = cfg[key]
    for field in ("rope_theta", "norm_eps"):
        if not isinstance(values.get(field), (int, float)) or isinstance(values.get(field), bool):
            raise CheckpointError(f"{where}: field {_CONFIG_KEYS[field]!r} must be a number, got {values.get(field)!r}")
        values[field] = float(values[field])
    if values.get("pad_id") is None:
        values.pop("pad_id", None)
    head_dim = cfg.get("head_dim")
    try:
        args = ModelArgs(**values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    if head_dim is not None and head_dim != args.head_dim:
        raise CheckpointError(
            f"{where}: field 'head_dim'={head_dim!r} must equal hidden_size/num_attention_heads={args.head_dim}"
        )
    dtype_name = cfg.get("torch_dtype", cfg.get("dtype", "float32"))
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{where}: field 'torch_dtype' must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    return args, _DTYPES[dtype_name]


def save_checkpoint(
    model: Transformer,
    folder: str | Path,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write `model` (and `tokenizer`, a `serving.tokenizer.Tokenizer`) as an HF Mixtral folder.

    Files are written to temporary names and renamed into place, weights last-but-config, so a
    reader never sees a half-written file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(model.parameters()).dtype
    state = {}
    for name, tensor in model.state_dict().items():
        if model.args.tie_embeddings and name == "lm_head.weight":
            continue
        state[hf_name(name)] = tensor.detach().to(dtype).contiguous().clone()
    if tokenizer is not None:
        tokenizer.save(folder)
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    args = model.args
    gen = {"bos_token_id": args.bos_id, "eos_token_id": args.eos_id, "pad_token_id": args.pad_id}
    atomic_write(folder / "generation_config.json", json.dumps(gen, indent=2))
    for name, text in (extra_files or {}).items():
        atomic_write(folder / name, text)
    atomic_write(folder / CONFIG, json.dumps(args_to_config(args, dtype), indent=2))
    return folder


def read_config(folder: str | Path) -> tuple[ModelArgs, torch.dtype]:
    folder = Path(folder)
    path = folder / CONFIG
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder (does not exist or is not a directory)")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return config_to_args(cfg, folder)


def load_state(folder: str | Path) -> dict[str, torch.Tensor]:
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def load_checkpoint(folder: str | Path, dtype: torch.dtype | None = None) -> Transformer:
    """Load a Mixtral folder into our `Transformer`; every tensor is checked by name, shape and dtype."""
    folder = Path(folder)
    args, file_dtype = read_config(folder)
    state = load_state(folder)
    model = Transformer(args)
    expected = {
        hf_name(n): p for n, p in model.state_dict().items() if not (args.tie_embeddings and n == "lm_head.weight")
    }
    where = folder / WEIGHTS
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} (config says {args})")
    for name, ref in expected.items():
        got = state[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(got.shape)}, config.json implies {tuple(ref.shape)}"
            )
        if got.dtype != file_dtype:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {got.dtype}, config.json says {file_dtype}")
    ours = {n: state[hf_name(n)] for n in model.state_dict() if not (args.tie_embeddings and n == "lm_head.weight")}
    model.load_state_dict(ours, strict=not args.tie_embeddings, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
