"""The rag workload's prompts: public documents of 300-1,000 tokens, marked, varied, two disjoint sets."""
from __future__ import annotations

import argparse
import statistics

from prefixcache import PrefixCache
from prefixcache.bench import add_arguments, rag, run


def test_documents_and_prompts(chat_llama, tokenizer, new_cache):
    spec = rag.RagSpec()
    timed, held_out = rag.documents(tokenizer, spec, 0), rag.documents(tokenizer, spec, 1)
    assert len(timed) >= spec.documents and len(held_out) >= spec.per_prompt[1]
    assert not {d.title for d in timed} & {d.title for d in held_out}
    for doc in timed + held_out:
        assert 300 <= len(tokenizer(doc.text, add_special_tokens=False)["input_ids"]) <= 1000
    cache: PrefixCache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    prompts = rag.prompts(cache, timed[: spec.documents], spec.requests, spec, "timed")
    assert len(prompts) == spec.requests and len({p.titles for p in prompts}) > spec.requests // 2
    texts = {d.title: d.text for d in timed}
    for p in prompts:
        assert spec.per_prompt[0] <= len(p.chunks) == len(p.titles) <= spec.per_prompt[1]
        for (s, e), title in zip(p.chunks, p.titles):
            assert tokenizer.decode(p.ids[s:e]) == texts[title]
        assert p.ids[: p.chunks[0][0]] == prompts[0].ids[: prompts[0].chunks[0][0]]  # one system prompt


def test_rag_runs_on_its_own(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--workloads", "rag,shared-prefix"])) == 2
    assert "on its own" in capsys.readouterr().err


def test_fidelity_rows_on_a_tiny_model(chat_llama, tokenizer, new_cache):
    """The fidelity pass end to end (documents stored, each share blended, scored); share 1 is a full prefill."""
    import time

    spec = rag.RagSpec(fidelity_prompts=1, answer_tokens=3, shares=(0.0, 1.0), per_prompt=(2, 2))
    cache: PrefixCache = new_cache(chat_llama, tokenizer, start_sweeper=False, batching=False)
    held_out = rag.prompts(cache, rag.documents(tokenizer, spec, 1)[:3], 1, spec, "held-out")
    result = rag.RagResult(spec, {}, cache.config.blend_recompute_share)
    rag._fidelity(result, chat_llama, cache, held_out, spec, lambda line: None, time.perf_counter)
    zero, full = result.fidelity
    assert full["agree"] == 1.0 and abs(full["loglik_gap_per_token"]) < 1e-4
    assert full["leading_equal"] == spec.answer_tokens and 0 <= zero["leading_equal"] <= spec.answer_tokens
    assert zero["loglik_gap_per_token"] != 0.0
    assert full["parting_margins"] == [] and len(result.margins) == 1 and len(result.margins[0]) == spec.answer_tokens
    assert all(m >= 0 for m in result.margins[0])
    assert [r["dtype"] for r in result.references] == list(spec.reference_dtypes)
    for ref in result.references:
        assert 0 <= ref["leading_equal"] <= spec.answer_tokens
        assert (ref["agree"] == 1.0) == (ref["parting_margins"] == [])
    text = "\n".join(rag.fidelity_lines(result))
    assert "Where answers part" in text and "| bfloat16 |" in text
    for ref in result.references:  # agreement on the answers the lower precision leaves alone
        count, rows = rag.stable_agreement(result, ref["dtype"])
        assert count == (1 if ref["agree"] == 1.0 else 0)
        assert rows == [(0.0, count if zero["agree"] == 1.0 else 0), (1.0, count)]
        if ref["agree"] < 1:  # a dtype that moved no answer adds no line
            assert f"{ref['dtype']} full prefill also gives" in text and f"100% {count}/{count}." in text
        else:
            assert f"the {ref['dtype']} full prefill also gives" not in text


def test_concurrent_blending_clients_on_both_engines(chat_llama, tokenizer, new_cache):
    """Each engine serves the same blending calls at once; the batching engine's answers equal the serial one's."""
    import time

    spec = rag.RagSpec(clients=3, client_tokens=3, client_rounds=1, per_prompt=(2, 2))
    cache: PrefixCache = new_cache(chat_llama, tokenizer, start_sweeper=False, batching=False)
    timed = rag.prompts(cache, rag.documents(tokenizer, spec, 0)[: spec.documents], 4, spec, "timed")
    result = rag.RagResult(spec, {}, cache.config.blend_recompute_share)
    rag._concurrent(result, chat_llama, tokenizer, timed, spec, lambda line: None, time.perf_counter)
    serial, batching = result.concurrent
    assert (serial["executors"], batching["executors"]) == (["serial"], ["batched"])
    assert serial["blended"] == batching["blended"] == 3 and batching["same_answers"]
    assert batching["tokens_per_s"] > 0 and serial["ttft_p50"] > 0


def test_timed_arms_on_both_engines_each_against_prefix_reuse_on_its_engine(chat_llama, tokenizer, new_cache):
    """The timed table's arms, the batching engine's (how the SDK serves by default) beside the serial engine's."""
    import time

    spec = rag.RagSpec(timed_shares=(0.15,), per_prompt=(2, 2), output_tokens=2)
    serial = {name: new_cache(chat_llama, tokenizer, start_sweeper=False, batching=False)
              for name in (rag.PREFIX_ONLY, rag._arm(0.15))}
    default = serial[rag.PREFIX_ONLY].config.blend_recompute_share
    batched = {name + rag.ON_BATCHING: new_cache(chat_llama, tokenizer, start_sweeper=False)
               for name in (rag.PREFIX_ONLY, rag._arm(default))}
    timed = rag.prompts(serial[rag.PREFIX_ONLY], rag.documents(tokenizer, spec, 0)[: spec.documents], 3, spec, "timed")
    result = rag.RagResult(spec, {"cpu": "cpu", "cpus": 1, "torch_threads": 1, "torch": "t", "transformers": "t"},
                           default)
    rag._timed(result, chat_llama, {**serial, **batched}, timed, spec, lambda line: None, time.perf_counter)
    assert list(result.ttft) == ["no cache (generate)", rag.PREFIX_ONLY, rag._arm(0.15), *batched]
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in result.ttft.values())
    assert result.prefix_answers_equal == 3
    blended = batched[rag._arm(default) + rag.ON_BATCHING]
    assert blended.last_call.executor == "batched" and blended.last_call.chunk_reused_tokens > 0
    result.full_ttft = [1.0]
    table = rag.markdown(result)
    p50 = {arm: statistics.median(v) for arm, v in result.ttft.items()}
    ratio = p50[rag._arm(default) + rag.ON_BATCHING] / p50[rag.PREFIX_ONLY + rag.ON_BATCHING]
    assert f"| {rag._arm(default)}{rag.ON_BATCHING} | {p50[rag._arm(default) + rag.ON_BATCHING]:.3f} |" in table
    assert f"{ratio:.2f}x |" in table


def test_agreement_on_the_answers_a_lower_precision_leaves_alone():
    """Only prompts whose float32 answer the lower-precision full prefill reproduces count, per share."""
    spec = rag.RagSpec(answer_tokens=4, shares=(0.0, 0.15, 1.0))
    result = rag.RagResult(spec, {}, 0.15, margins=[[1.0] * 4] * 4)
    result.fidelity = [{"share": 0.0, "leads": [4, 0, 1, 4], "parting_margins": []},
                       {"share": 0.15, "leads": [4, 4, 3, 2], "parting_margins": []},
                       {"share": 1.0, "leads": [4, 4, 4, 4], "parting_margins": []}]
    result.fidelity = [{**row, "agree": 0.0, "first_token": 0.0, "leading_equal": 0.0, "loglik_gap_per_token": 0.0,
                        "loglik_gap_max": 0.0, "ttft_p50": 0.0} for row in result.fidelity]
    result.full_ttft = [1.0] * 4
    result.references = [{"dtype": "bfloat16", "agree": 0.5, "leading_equal": 3.0, "parting_margins": [1.0, 1.0],
                          "leads": [4, 2, 0, 4]},
                         {"dtype": "float16", "agree": 1.0, "leading_equal": 4.0, "parting_margins": [],
                          "leads": [4, 4, 4, 4]}]
    assert rag.stable_agreement(result, "bfloat16") == (2, [(0.0, 2), (0.15, 1), (1.0, 2)])
    assert rag.stable_agreement(result, "float16") == (4, [(0.0, 2), (0.15, 2), (1.0, 4)])
    text = "\n".join(rag.fidelity_lines(result))
    assert "On the 2 prompts whose float32 answer the bfloat16 full prefill also gives" in text
    assert "0% 2/2, 15% 1/2, 100% 2/2." in text and "the float16 full prefill also gives" not in text
