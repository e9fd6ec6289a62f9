"""Shared fixtures: tiny random models of several architectures, and the default model; and two checks
around every test: no thread of ours outlives the test that started it, and (opt-in) slower model steps."""
from __future__ import annotations

import copy
import os
import pathlib
import shutil
import threading
import time
import weakref

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from prefixcache import PrefixCache
from tests.step_hooks import step_delay

TINY_VOCAB = 320
PAD, EOS = 0, 1

#: Seconds added to every batched model step (``tests/step_hooks.py``), from PREFIXCACHE_TEST_STEP_DELAY:
#: the timing-dependent tests must pass on a ~10x slower machine too. Read here only, never by the package.
STEP_DELAY = float(os.environ.get("PREFIXCACHE_TEST_STEP_DELAY") or 0)
#: The name prefix of every thread the package starts (and the tests' own servers): none may outlive its test.
OUR_THREADS = "prefixcache-"
#: Seconds a thread of ours may take to end after its test (a pool's workers wind down after its shutdown).
THREAD_GRACE = 2.0
#: torch's intra-op threads in the test process and in the processes the tests start. The tests' models are tiny
#: (a step is a few small products, dominated by dispatch) and servers run beside the tests on the same cores: a
#: second thread only adds contention, many times slower on a busy 2-core machine.
TORCH_THREADS = 1


@pytest.fixture(scope="session", autouse=True)
def slower_steps():
    """Every batched step ``STEP_DELAY`` s longer in this process (test_replicas passes it on to its replicas)."""
    with step_delay(STEP_DELAY):
        yield


@pytest.fixture(scope="session", autouse=True)
def few_torch_threads():
    """``TORCH_THREADS`` for the session: here, and through ``OMP_NUM_THREADS`` in every process a test starts."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(TORCH_THREADS)
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(threads)
    if omp is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(autouse=True)
def torch_threads_reset():
    """Each test starts on ``TORCH_THREADS`` (an app built with ``torch_threads`` set changes it process-wide)."""
    torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves a thread of ours running: close every ``PrefixCache`` and server a test opens.

    Autouse, so set up before (and torn down after) the test's other function-scoped fixtures; the
    threads of module- and session-scoped fixtures (a server a module shares) already run before it.
    """
    before = set(threading.enumerate())
    yield
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith(OUR_THREADS)]
    deadline = time.monotonic() + THREAD_GRACE
    for t in ours:
        t.join(max(0.0, deadline - time.monotonic()))
    left = sorted(t.name for t in ours if t.is_alive())
    if left:
        pytest.fail(f"the test left threads running: {left} (close the PrefixCache or server that started them)",
                    pytrace=False)


_ARCHS = {
    # Llama with grouped-query attention (4 query heads share 2 KV heads).
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)),
    # Mistral with its sliding window larger than any test sequence: full attention holds.
    "mistral": lambda: MistralForCausalLM(MistralConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, sliding_window=4096)),
    # GPT-2: absolute position embeddings, so a wrong cache offset shows up at once.
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
        bos_token_id=EOS, eos_token_id=EOS)),
}
ARCHS = tuple(_ARCHS)

# A PrefixCache switches its model's attention implementation (cascade attention), so a
# reference answer computed with the wrapped model would share any bug of that switch.
_UNTOUCHED: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def keep_untouched(model: torch.nn.Module) -> torch.nn.Module:
    """Record a deep copy of ``model`` before any PrefixCache wraps it; returns ``model``."""
    _UNTOUCHED[model] = copy.deepcopy(model)
    return model


def untouched(model: torch.nn.Module) -> torch.nn.Module:
    """The deep copy of ``model`` made when it was built: the reference for parity checks."""
    return _UNTOUCHED[model]


def build_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = _ARCHS[arch]().eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = EOS
    return keep_untouched(model)


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request) -> torch.nn.Module:
    return build_tiny(request.param)


@pytest.fixture(scope="session")
def llama() -> torch.nn.Module:
    return build_tiny("llama-gqa")


@pytest.fixture(scope="session")
def default_model():
    from prefixcache import load_default_model

    model, tokenizer = load_default_model()
    return keep_untouched(model), tokenizer


class FakeClock:
    """Injected clock: tests move time explicitly and never sleep."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def new_cache():
    """``new_cache(...)`` takes ``PrefixCache``'s arguments; every cache it made is closed after the test."""
    caches: list[PrefixCache] = []

    def make(*args, **kwargs) -> PrefixCache:
        caches.append(PrefixCache(*args, **kwargs))
        return caches[-1]

    yield make
    for cache in caches:
        cache.close()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (its converted copy's files, no weights): ``default_model`` for both."""
    from prefixcache.loading import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def chat_llama(tokenizer) -> torch.nn.Module:
    """A tiny random Llama over the real SmolLM2 vocabulary, so chat templates work."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return keep_untouched(model)


@pytest.fixture
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port (no persistence), stopped after the test."""
    from tests.support.redis_server import RedisServer

    if shutil.which("redis-server") is None:  # shown by -ra: never a silent pass
        pytest.skip("redis-server is not installed: run `make system-deps` as root, or apt-get install redis-server")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer) -> pathlib.Path:
    """A 2-layer random Llama over the real SmolLM2 tokenizer (chat template included), saved."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
