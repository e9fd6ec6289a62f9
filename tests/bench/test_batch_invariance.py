"""The batch-invariance measurement (python -m benchmarks.batch_invariance) on a tiny model."""
from __future__ import annotations

import torch

from benchmarks.batch_invariance import _first_difference, linear_probe, measure, prefix_attention_cost


def test_first_difference():
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2


def test_measure_on_a_tiny_chat_model_in_float32(chat_llama, tokenizer):
    got = measure(chat_llama, tokenizer, callers=3, new_tokens=4, probe=True)
    assert got["dtype"] == "float32" and got["callers"] == 3
    for engine in ("batched", "serial"):
        r = got[engine]
        # float32 on both engines: every answer equals plain generate(), alone and together
        assert r["alone == together"] == r["alone == generate()"] == r["together == generate()"] == 3
        assert r["first difference alone/together"] == [None] * 3
        assert all(c > 0 for c in r["cached tokens alone"] + r["cached tokens together"])  # the warmed prompt
    assert set(got["linear probe"]) == {"64x64", "32x64", "128x64", "64x128", f"{len(tokenizer)}x64"}


def test_linear_probe_reports_row_count_dependence():
    class RowByRow(torch.nn.Linear):
        def forward(self, x):  # each row alone: its bits cannot depend on the other rows
            return torch.cat([super(RowByRow, self).forward(row[None]) for row in x])

    class RowDependent(torch.nn.Linear):
        def forward(self, x):  # a kernel whose rounding depends on the number of rows
            return super().forward(x) + (x.shape[0] > 1) * 1e-3

    model = torch.nn.Sequential(RowByRow(8, 4), RowDependent(4, 6))
    got = linear_probe(model)
    assert got["4x8"]["row counts changing row 0"] == []
    assert got["6x4"]["row counts changing row 0"] == [2, 4, 8, 16]


def test_prefix_attention_cost_times_both_ways(llama):
    got = prefix_attention_cost(llama, rows=4, prefix=64, repeats=3)
    assert got["rows"] == 4 and got["prefix"] == 64 and got["layers"] == llama.config.num_hidden_layers
    assert got["one_product_s"] > 0 and got["row_by_row_s"] > 0
    assert got["ratio"] == got["row_by_row_s"] / got["one_product_s"]
