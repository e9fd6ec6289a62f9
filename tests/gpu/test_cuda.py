"""The batching engine on CUDA: fused kernels equal the reference cascade, the start-up check passes
in float32/bfloat16/float16 and refuses a broken cascade, float32 answers equal ``generate()``, and
documents blend there.
Skipped without CUDA (the device path is tested where it runs)."""
from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.cache.scope import Scope
from prefixcache.errors import UnsupportedModelError
from prefixcache.model.cascade import PrivateBatch, Shared, TorchKernels, cascade_attention, kernels_for
from prefixcache.model.cuda import FusedKernels
from prefixcache.model.cuda.attention import fused_kernels
from prefixcache.model.hf_cache import check_cascade, enable_cascade_attention, measure_cascade, probe_layout
from prefixcache.serving.engine import BatchConfig
from prefixcache.serving.request import SamplingParams
from tests.conftest import ARCHS, build_tiny, untouched
from tests.model.test_cascade_dtypes import BROKEN as CPU_BROKEN
from tests.model.test_fused_kernels import _alone_not_causal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_cuda(arch: str, dtype: torch.dtype):
    model = build_tiny(arch).to(device="cuda", dtype=dtype)
    layout = probe_layout(model)
    enable_cascade_attention(model)
    return model, layout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 80])
def test_fused_kernels_equal_the_reference_cascade(dtype, d):
    gen = torch.Generator().manual_seed(d)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to("cuda", dtype)

    hq, hkv = 8, 2
    shared = [Shared(rand(hkv, 300, d), rand(hkv, 300, d), (0, 1, 2, 3)), Shared(rand(hkv, 70, d), rand(hkv, 70, d), (1, 3))]
    private = [(rand(hkv, 50, d), rand(hkv, 50, d)), (rand(hkv, 40 + 33, d), rand(hkv, 40 + 33, d))]
    keys, values = rand(3, hkv, 90, d), rand(3, hkv, 90, d)
    batch = PrivateBatch.build(keys, values, rows=[83, 84], slots=[2, 0], lengths=[60, 90])
    q = rand(hq, 85, d)
    spans = [(0, 50), (50, 83), (83, 84), (84, 85)]
    kernels = kernels_for(q.device, q.dtype, d)
    assert isinstance(kernels, FusedKernels) and kernels.flash == (dtype != torch.float32 and d % 8 == 0)
    got = cascade_attention(q, spans, shared, [*private, None, None], d ** -0.5, [batch])
    want = cascade_attention(q.double(), spans, [Shared(s.keys.double(), s.values.double(), s.members) for s in shared],
                             [(k.double(), v.double()) for k, v in private] + [None, None], d ** -0.5,
                             [PrivateBatch.build(keys.double(), values.double(), [83, 84], [2, 0], [60, 90])],
                             kernels=TorchKernels())
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_float64_on_cuda_takes_the_reference_path():
    assert fused_kernels(torch.float64, 64) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_start_up_check_passes_and_batching_is_on(arch, dtype):
    model, layout = on_cuda(arch, dtype)
    check_cascade(model, layout)
    with PrefixCache(model, batching=True, start_sweeper=False) as pc:
        assert pc.batching_disabled_reason is None


_REAL_CALL = FusedKernels._call


def _never_causal(self, q, k, v, scale, causal, widen=True):
    return _REAL_CALL(self, q, k, v, scale, False, widen)


BROKEN = {
    **{bug: CPU_BROKEN[bug] for bug in ("private KV written one position late", "merge drops the shared prefix")},
    "held tokens ignored": (FusedKernels, "causal", lambda self, q, k, v, scale, masks:
                            TorchKernels().causal(q.float(), k[:, :, -q.shape[3]:].float(),
                                                  v[:, :, -q.shape[3]:].float(), scale, {})),
    "causal flag dropped": (FusedKernels, "_call", _never_causal),
    "a prompt alone not causal": (FusedKernels, "alone", _alone_not_causal),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bug", BROKEN)
def test_a_broken_cascade_is_refused_on_cuda(bug, dtype, monkeypatch):
    model, layout = on_cuda("llama-gqa", dtype)
    check_cascade(model, layout)
    monkeypatch.setattr(*BROKEN[bug])
    with pytest.raises(UnsupportedModelError):
        check_cascade(model, layout)


def test_a_step_at_shifted_positions_is_refused_on_cuda():
    from prefixcache.model.hf_cache import CASCADE_KWARG

    model, layout = on_cuda("llama-gqa", torch.bfloat16)

    def shifted(ids, pos, cache, keep):
        return model(input_ids=ids.unsqueeze(0), position_ids=(pos + 1).unsqueeze(0), past_key_values=cache,
                     use_cache=True, **{CASCADE_KWARG: cache}).logits[0, keep]

    with pytest.raises(UnsupportedModelError):
        check_cascade(model, layout, shifted)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_answers_equal_generate_serially_and_concurrently(arch):
    import threading

    model = build_tiny(arch).to("cuda")
    ref = untouched(model).to("cuda")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40 + 3 * i)] for i in range(8)]
    want = [ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, min_new_tokens=12,
                         do_sample=False)[0, len(p):].tolist() for p in prompts]
    with PrefixCache(model, start_sweeper=False) as pc:
        assert pc.batching_disabled_reason is None
        serial = [pc.generate([p], max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
        got: list = [None] * len(prompts)

        def client(i):
            p = prompts[i]
            got[i] = pc.generate([p], max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert serial == want
    assert got == want


def test_a_sampled_request_batched_with_greedy_ones_is_served_on_cuda():
    """A seeded sampled request draws from its own generator: beside greedy requests in the same steps it
    neither fails nor changes their answers, and its seed gives the same draws twice."""
    import threading

    model = build_tiny("llama-gqa").to("cuda")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(30 + 2 * i)] for i in range(4)]
    with PrefixCache(model, start_sweeper=False) as pc:
        greedy = [pc.generate([p], max_new_tokens=8, do_sample=False)[0, len(p):].tolist() for p in prompts]
        got: list = [None] * len(prompts)
        sampled: list = []

        def client(i):
            p = prompts[i]
            got[i] = pc.generate([p], max_new_tokens=8, do_sample=False)[0, len(p):].tolist()

        def sampler():
            p = prompts[0]
            sampled.append(pc.generate([p], max_new_tokens=8, do_sample=True, temperature=0.8, seed=7)[0].tolist())

        for _ in range(2):
            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
            threads.append(threading.Thread(target=sampler))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got == greedy
        assert pc.batching_disabled_reason is None and pc.batcher.failure is None
    assert len(sampled) == 2 and sampled[0] == sampled[1]


def test_unseeded_sampled_rows_are_drawn_together_on_cuda_from_their_distribution():
    """``draw_rows`` on CUDA logits (the engine's default there): at evenly spaced uniforms a row gives each
    token its probability under transformers' warpers; and unseeded requests served beside seeded and
    greedy ones leave those as the host path leaves them."""
    import threading

    from prefixcache.serving.sampling import Sampler, draw_rows

    n, vocab = 4000, 300
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 4
    for warp in ((0.8, 40, 0.9), (1.0, 0, 0.5), (1.7, 5, 1.0)):
        t, k, p = warp
        sampler = Sampler(SamplingParams(temperature=t, top_k=k or None, top_p=None if p == 1.0 else p), 1)
        want = torch.softmax(sampler.processors(torch.tensor([[0]]), row[None].clone())[0], -1).double()
        got = draw_rows(row.cuda().expand(n, vocab), [warp] * n, [(i + 0.5) / n for i in range(n)])
        counts = torch.bincount(torch.tensor(got), minlength=vocab).double() / n
        assert torch.all(counts[want == 0] == 0) and torch.allclose(counts, want, atol=1.5 / n + 1e-5)
    model = build_tiny("llama-gqa").to("cuda")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(30 + 2 * i)] for i in range(4)]
    options = ({"do_sample": True, "temperature": 1.2}, {"do_sample": True, "temperature": 1.2, "seed": 3},
               {"do_sample": False}, {"do_sample": True, "temperature": 0.9, "top_p": 0.8})

    def served(together: bool) -> list:
        with PrefixCache(model, start_sweeper=False, batching=BatchConfig(draw_together=together)) as pc:
            out: list = [None] * 4

            def client(i):
                out[i] = pc.generate([prompts[i]], max_new_tokens=8, **options[i])[0, len(prompts[i]):].tolist()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert pc.batcher.failure is None
            return out
    together, apart = served(True), served(False)
    assert together[2] == apart[2]  # greedy
    assert served(True)[1] == together[1]  # seeded: drawn on the device, the same tokens again
    assert all(len(a) == 8 and all(0 <= t < model.config.vocab_size for t in a) for a in together)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_reduced_precision_layers_measured(dtype, capsys):
    """Print the per-layer errors of the check on CUDA (the fused kernels round in the model's dtype)."""
    model, layout = on_cuda("llama-gqa", dtype)
    m = measure_cascade(model, layout, rows=6)
    with capsys.disabled():
        for i, e in enumerate(m.layers):
            print(f"\n{dtype} layer {i}: cascade {e.cascade:.3g} plain {e.plain:.3g} scale {e.scale:.3g}")
    assert m.exact < 1e-4


def test_seeded_rows_drawn_at_once_on_cuda_draw_what_multinomial_draws_row_by_row():
    from tests.serving.test_sampler import seeded_against_multinomial

    seeded_against_multinomial("cuda")


def test_seeded_rows_on_cuda_draw_what_a_seeded_generate_draws_there():
    """float32 on CUDA: seeded requests drawn on the device (``draw_seeded``, the default there) get the tokens
    ``generate()`` draws after ``torch.manual_seed`` on that device, alone and beside each other (warped at
    once), unseeded and greedy requests; a seeded row with a penalty draws on the host, the same seed the same
    tokens again."""
    import threading

    model = build_tiny("llama-gqa").to("cuda")
    ref = untouched(model).to("cuda")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(30 + 2 * i)] for i in range(4)]
    for warps in ({"temperature": 1.2, "top_k": 0}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9}):
        want = {}
        for seed, i in ((3, 0), (5, 3)):
            torch.manual_seed(seed)
            want[i] = ref.generate(torch.tensor([prompts[i]], device="cuda"), max_new_tokens=8, do_sample=True,
                                   **warps)[0].tolist()
        with PrefixCache(model, start_sweeper=False) as pc:
            alone = pc.generate([prompts[0]], max_new_tokens=8, do_sample=True, seed=3, **warps)[0].tolist()
            assert alone == want[0]
            got: list = [None] * 5
            options = ({"do_sample": True, "seed": 3, **warps}, {"do_sample": True, "temperature": 1.1, "top_p": 0.8},
                       {"do_sample": False}, {"do_sample": True, "seed": 5, **warps},
                       {"do_sample": True, "seed": 3, "repetition_penalty": 1.3, **warps})

            def client(i):
                got[i] = pc.generate([prompts[i % 4]], max_new_tokens=8, **options[i])[0].tolist()
            penalised = []
            for _ in range(2):
                threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert got[0] == want[0] and got[3] == want[3]
                penalised.append(got[4])
            assert penalised[0] == penalised[1]
            assert pc.batching_disabled_reason is None and pc.batcher.failure is None


def _decode_burst(engine, prompts, news):
    reqs = [engine.submit(p, Scope(("t", "m"), "t"), SamplingParams(max_new_tokens=n, min_new_tokens=n))
            for p, n in zip(prompts, news)]
    return [engine.wait(r, timeout=120).tokens for r in reqs]


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen2"])
def test_decode_steps_are_captured_as_cuda_graphs_and_answer_exactly(arch):
    """float32: requests leaving at different steps (each stretch one step shape, captured as a CUDA graph
    and replayed): answers equal ``generate()``; the graphs were captured, replayed and never switched off."""
    model = build_tiny(arch).to("cuda")
    ref = untouched(model).to("cuda")
    prefix = [5 + (j * 13) % 300 for j in range(48)]
    prompts = [prefix + [100 + i] * (1 + i % 3) for i in range(6)]
    news = [30, 12, 24, 6, 18, 36]
    want = [ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)[0, len(p):].tolist() for p, n in zip(prompts, news)]
    with PrefixCache(model, start_sweeper=False) as pc:
        assert pc.batching_disabled_reason is None
        engine = pc.batcher
        engine.generate(prefix, Scope(("t", "m"), "t"), SamplingParams(max_new_tokens=1))
        got = _decode_burst(engine, prompts, news)
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.disabled is None, graphs and graphs.disabled
        assert graphs.captures >= 3 and graphs.replays >= 20, (graphs.captures, graphs.replays)
    assert got == want


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_decode_steps_are_captured_in_reduced_precision(dtype):
    """bfloat16/float16: captured steps replay what the eager step computed (the capture's own check),
    and the same greedy answers as an engine that runs every step eagerly."""
    prefix = [5 + (j * 13) % 300 for j in range(48)]
    prompts = [prefix + [100 + i] * (1 + i % 3) for i in range(6)]
    news = [30, 12, 24, 6, 18, 36]
    answers = {}
    for graphs_on in (False, True):
        model = build_tiny("llama-gqa").to("cuda", dtype)
        with PrefixCache(model, start_sweeper=False, batching=BatchConfig(step_graphs=graphs_on)) as pc:
            engine = pc.batcher
            assert (engine.runner.graphs is not None) == graphs_on
            engine.wait(engine.submit(prefix, Scope(("t", "m"), "t"), SamplingParams(max_new_tokens=1)))
            answers[graphs_on] = _decode_burst(engine, prompts, news)
            if graphs_on:
                assert engine.runner.graphs.disabled is None and engine.runner.graphs.replays >= 20
    assert answers[True] == answers[False]


HIT_SUFFIXES = [[7] * 3, [9, 8, 7, 6, 5], [5] * 3, list(range(30, 39)), list(range(40, 57)), [4] * 4, [6] * 3,
                list(range(60, 66)), list(range(70, 81))]


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen2"])
def test_hits_are_staged_and_captured_as_cuda_graphs_and_answer_exactly(arch):
    """float32: hits of 3-17 new tokens on a stored prefix, one after another (staged prompt steps: padded to
    a bucket of 16 or 32, captured as a CUDA graph once a bucket repeats, replayed after): answers equal
    ``generate()``. Bucket 16's second hit is captured and its later six replayed (the one hit of 17 tokens
    and the cold prefix's bucket of 64 are seen once); staging never switched off."""
    model = build_tiny(arch).to("cuda")
    ref = untouched(model).to("cuda")
    prefix = [5 + (j * 13) % 300 for j in range(48)]
    prompts = [prefix + suffix for suffix in HIT_SUFFIXES]
    want = [ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False)[0, len(p):].tolist() for p in prompts]
    scope = Scope(("t", "m"), "t")
    with PrefixCache(model, start_sweeper=False) as pc:
        engine = pc.batcher
        engine.generate(prefix, scope, SamplingParams(max_new_tokens=1))
        got = []
        for p in prompts:
            result = engine.generate(p, scope, SamplingParams(max_new_tokens=8, min_new_tokens=8))
            assert result.stats.cached_tokens == len(prefix)
            got.append(result.tokens)
        graphs = engine.runner.graphs
        assert graphs.prefill_disabled is None, graphs.prefill_disabled
        assert (graphs.staged_captures, graphs.staged_replays) == (1, 6)
    assert got == want


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_staged_hits_replayed_as_cuda_graphs_answer_as_the_same_steps_run_eagerly(dtype):
    """bfloat16/float16: staged hits replayed from CUDA graphs give the tokens of the same staged steps run
    kernel by kernel (a capture that reruns the step's Python)."""
    from tests.serving.test_step_graphs import engine_with, rerun

    prefix = [5 + (j * 13) % 300 for j in range(48)]
    scope = Scope(("t", "m"), "t")
    answers = {}
    for name, capture in (("eager", rerun), ("graphs", None)):
        model = build_tiny("llama-gqa").to("cuda", dtype)
        engine = engine_with(model, capture)
        try:
            engine.generate(prefix, scope, SamplingParams(max_new_tokens=1))
            answers[name] = [engine.generate(prefix + s, scope, SamplingParams(max_new_tokens=8)).tokens
                             for s in HIT_SUFFIXES]
            graphs = engine.runner.graphs
            assert graphs.prefill_disabled is None and graphs.staged_replays == 6, graphs.prefill_disabled
        finally:
            engine.close()
    assert answers["graphs"] == answers["eager"]


def test_documents_blend_on_cuda():
    """float32 on CUDA: a first sight is prefilled and its documents stored; moved documents blended at the
    default share give, on the batching engine (serving the serial engine's blend), the serial engine's tokens
    and counts; blended at share 1 they answer as ``generate()``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build_tiny("llama-gqa").to("cuda")
    ref = untouched(model).to("cuda")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(model.config.vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)  # built here: nothing to load on the device
    head, doc_a, doc_b, tail, other = ([first + (j * m) % 250 for j in range(n)]
                                       for first, n, m in ((5, 12, 7), (40, 40, 11), (41, 33, 13), (6, 6, 3), (7, 5, 2)))
    first, moved, again = head + doc_a + doc_b + tail, head + doc_b + doc_a + tail, head + doc_b + doc_a + other
    spans, moved_spans = ((12, 52), (52, 85)), ((12, 45), (45, 85))
    opts = {"max_new_tokens": 8, "ignore_eos": True}
    want = ref.generate(torch.tensor([again], device="cuda"), max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(again):].tolist()  # ignore_eos: an end token may come, and not stop
    got = {}
    for batching in (True, False):
        with PrefixCache(model, tokenizer, start_sweeper=False, batching=batching) as pc:
            assert (pc.batching_disabled_reason is None) == batching
            seen = pc.answer(first, chunks=spans, **opts)
            assert seen.stats.chunk_stored_tokens == 73 and seen.stats.chunk_reused_tokens == 0
            blended = pc.answer(moved, chunks=moved_spans, **opts)
            assert blended.stats.executor == ("batched" if batching else "serial")
            assert blended.stats.chunk_reused_tokens > 0 and blended.stats.chunk_recomputed_tokens > 0
            got[batching] = (list(blended.token_ids), blended.stats.chunk_reused_tokens,
                             blended.stats.chunk_recomputed_tokens)
            full = pc.answer(again, chunks=moved_spans, blend=1.0, **opts)
            assert list(full.token_ids) == want and full.stats.chunk_reused_tokens == 0
            assert full.stats.chunk_recomputed_tokens == 85 - full.stats.cached_tokens  # every document token after it
    assert got[True] == got[False]


def _word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over ``w0 .. w{vocab_size-1}``: built here, nothing to load on the device."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def _byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens and ``<eos>`` as 256): a fast tokenizer llguidance
    reads, built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<eos>": len(alphabet)}
    bpe = Tokenizer(models.BPE(vocab, []))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "serial"])
def test_logprobs_on_cuda_are_the_model_s_own(batching):
    """float32 on CUDA: greedy and sampled answers' logprobs, cold and cached and from concurrent callers, equal
    the untouched model's log_softmax (the chosen token's and the top 4's, in order)."""
    import threading

    model = build_tiny("llama-gqa").to("cuda")
    ref = untouched(model).to("cuda")
    prompts = [[5 + (i * 7 + j) % 250 for j in range(40 + 3 * i)] for i in range(3)]
    options = ({}, {"temperature": 0.9, "seed": 4}, {"temperature": 1.1})

    def check(prompt, result):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + list(result.token_ids)], device="cuda")).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) - 1 + len(result.token_ids)].cpu()
        assert len(result.logprobs) == len(result.token_ids) == 6
        for step, entry in enumerate(result.logprobs):
            assert entry.token == result.token_ids[step]
            assert abs(entry.logprob - float(want[step, entry.token])) <= 1e-4
            values, index = torch.topk(want[step], 4)
            assert [t for t, _ in entry.top] == index.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)

    with PrefixCache(model, _word_tokenizer(model.config.vocab_size), start_sweeper=False,
                     batching=batching) as pc:
        for _ in range(2):  # cold, then cached
            for prompt, option in zip(prompts, options):
                result = pc.answer(prompt, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=4, **option)
                assert result.stats.executor == ("batched" if batching else "serial")
                check(prompt, result)
        got: list = [None] * 3

        def client(i):
            asked = {"logprobs": True, "top_logprobs": 4} if i != 2 else {}
            got[i] = pc.answer(prompts[i], max_new_tokens=6, ignore_eos=True, **asked, **options[i])
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for prompt, result in zip(prompts[:2], got[:2]):
            check(prompt, result)
        assert got[2].logprobs is None
        if batching:
            assert pc.batching_disabled_reason is None and pc.batcher.failure is None


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_structured_outputs_on_cuda_match_the_schema(dtype):
    """response_format on CUDA: greedy, seeded and unseeded answers of a random model, served concurrently on the
    batching engine beside a free row, parse and match the schema; greedy ones equal the serial engine's."""
    import json
    import threading

    import jsonschema
    from transformers import LlamaConfig, LlamaForCausalLM

    schema = {"type": "object", "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2}},
        "required": ["kind", "age", "name", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    tokenizer = _byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    model = model.to("cuda", dtype)
    samplings = ({}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_p": 0.9})
    prompt = "Describe a pet as JSON: "
    answers: dict = {}
    for batching in (True, False):
        with PrefixCache(model, tokenizer, start_sweeper=False, batching=batching) as pc:
            got: list = [None] * 4

            def client(i):
                if i == 3:  # a free row in the same steps
                    got[i] = pc.complete("Once upon a time", max_new_tokens=20)
                else:
                    got[i] = pc.complete(prompt, response_format=fmt, max_new_tokens=120, **samplings[i])
            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for result in got[:3]:
                assert result.stats.executor == ("batched" if batching else "serial")
                assert result.finish_reason == "stop", result.text
                jsonschema.validate(json.loads(result.text), schema)
            assert got[3].finish_reason == "length"
            answers[batching] = got[0].token_ids
            if batching:
                assert pc.batching_disabled_reason is None and pc.batcher.failure is None
    assert answers[True] == answers[False]
