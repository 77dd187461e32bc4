"""What a verify forward costs against the rows it verifies, on this machine: the target's forward over n new query
rows after a cached prefix, and its output layer alone over n rows, each against one row.

Which tree sizes can pay is set by this curve, and the curve is the CPU's matrix-product kernels, not the model:
on a Xeon with AMX (fp32, one thread) SmolLM2-135M's output layer costs the same for 1 to 3 rows and twice that at 4;
on an AMD EPYC it costs per row up to 3 rows (two separate matrix-vector passes for 2 rows) and less at 4 than at 3
(RCOST-6, RCOST-7 in docs/experiments/round-cost.md). The round controller measures its choices' costs, so it adapts
to either; this script shows why a choice won or lost.

    python benchmarks/forward_rows.py --target smollm2-135m-instruct --threads 1
    python benchmarks/forward_rows.py                      # tiny random Llama (hidden 64): overhead only

Prints a markdown table: rows, forward ms, forward / one row, output layer ms, output layer / one row (medians).
"""

import argparse

import torch
from transformers import DynamicCache

from transformers_jakiro.bench.tune import _median_time
from transformers_jakiro.decoding.kv_cache import truncate
from transformers_jakiro.decoding.target_inputs import cache_kwarg


def _median_ms(function, repeats: int, device) -> float:
    function()  # warm-up: kernels picked and buffers allocated for this shape
    return 1000 * _median_time(function, repeats, device)  # `jakiro bench --tune`'s timer (device synced)


@torch.no_grad()
def measure(target, rows: list[int], prefix: int = 200, repeats: int = 5) -> list[dict]:
    """Per row count n: the median ms of the target's forward over n tokens after `prefix` cached positions (the
    cache cut back after each, as a round's is) and of its output layer over n hidden rows."""
    vocab = target.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    device = target.get_input_embeddings().weight.device
    prompt = torch.randint(0, vocab, (1, prefix), generator=generator).to(device)
    cache = DynamicCache()
    cached = {cache_kwarg(target): cache}  # `cache` or `past_key_values`, as this transformers' forward names it
    target(prompt, use_cache=True, **cached)
    head = target.get_output_embeddings()
    table = []
    for n in rows:
        tokens = torch.randint(0, vocab, (1, n), generator=generator).to(device)
        hidden = torch.randn(n, head.weight.shape[1], generator=generator, dtype=head.weight.dtype).to(device)

        def forward():
            target(tokens, use_cache=True, **cached)
            truncate(cache, prefix)

        table.append({"rows": n, "forward_ms": _median_ms(forward, repeats, device),
                      "output_layer_ms": _median_ms(lambda: head(hidden), repeats, device)})
    one = table[0] if table and table[0]["rows"] == 1 else None
    for entry in table:
        entry["forward_x"] = entry["forward_ms"] / one["forward_ms"] if one else None
        entry["output_layer_x"] = entry["output_layer_ms"] / one["output_layer_ms"] if one else None
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| rows | forward ms | forward / 1 row | output layer ms | output layer / 1 row |",
             "|---:|---:|---:|---:|---:|"]
    for entry in table:
        ratios = [f"{entry[key]:.2f}x" if entry[key] is not None else "" for key in ("forward_x", "output_layer_x")]
        lines.append(f"| {entry['rows']} | {entry['forward_ms']:.1f} | {ratios[0]} | {entry['output_layer_ms']:.3f} "
                     f"| {ratios[1]} |")
    return "\n".join(lines)


def load(name: str, dtype: torch.dtype):
    if name == "tiny-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(dtype).eval()
    from transformers_jakiro.targets import load_target

    return load_target(name, dtype=dtype)[0]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny-llama", help="tiny-llama, or a registry name / path for load_target")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,17", help="comma-separated query row counts")
    parser.add_argument("--prefix", type=int, default=200, help="cached positions before the rows")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load(args.target, getattr(torch, args.dtype))
    rows = sorted({int(n) for n in args.rows.split(",")})
    table = measure(target, rows, args.prefix, args.repeats)
    print(f"{args.target} {args.dtype}, {args.threads} thread(s), {args.prefix} cached positions\n")
    print(markdown(table))
    return table


if __name__ == "__main__":
    main()
