"""`benchmarks/forward_rows.py`: a verify forward's cost against its rows (times are printed, never asserted)."""

from benchmark_scripts import load_script


def test_the_forward_rows_script_times_each_row_count_against_one_row(capsys):
    script = load_script("forward_rows.py", "forward_rows")
    table = script.main(["--rows", "3,1", "--repeats", "1", "--prefix", "16"])
    assert [entry["rows"] for entry in table] == [1, 3]
    assert table[0]["forward_x"] == 1.0 and table[0]["output_layer_x"] == 1.0
    assert all(entry["forward_ms"] > 0 and entry["output_layer_ms"] > 0 for entry in table)
    printed = capsys.readouterr().out
    assert "| rows | forward ms |" in printed
    assert sum(line.startswith("|") for line in printed.splitlines()) == 4  # header, rule, two rows
