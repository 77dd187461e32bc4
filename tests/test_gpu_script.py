"""The H200 round-cost script runs end to end on the CPU at a tiny shape (so it cannot rot between GPU runs),
compiled pair included: traced by dynamo with full graphs and run with the `eager` backend, which skips inductor's
code generation (a minute on 2 cores; tests/test_compiled_decoding.py covers inductor)."""

from benchmark_scripts import load_script


def test_round_cost_script_tiny_cpu(tmp_path):
    module = load_script("gpu/round_cost.py", "round_cost")
    out = tmp_path / "round.json"
    result = module.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "3",
                          "--warmup", "1", "--context", "32", "--compile-backend", "eager", "--out", str(out)])
    assert out.exists()
    assert result["tree"] == {"total_tokens": 60, "depth": 5, "top_k": 10, "levels": 6}
    assert result["plain_step_ms"] > 0 and result["jakiro_round_ms"] > 0
    assert result["round_over_plain"] == round(result["jakiro_round_ms"] / result["plain_step_ms"], 3)
    assert result["plain_compiled_step_ms"] > 0 and result["jakiro_compiled_round_ms"] > 0
    assert result["compile_backend"] == "eager" and result["verified_nodes"] == 61 and result["static_cache_length"] >= 32 + 61
