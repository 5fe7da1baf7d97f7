"""tokenmill-bench routing's workload: the same prompts for every mode, shared system prompts (or, as
the control, none shared), and its table."""

from __future__ import annotations

from tokenmill_bench.routing import build_parser, format_table, workload


def test_the_shared_workload_is_a_few_long_system_prompts_each_with_its_own_question() -> None:
    args = build_parser().parse_args([])
    assert (args.system_prompts, args.system_tokens, args.requests, args.workers) == (8, 1500, 200, 2)
    prompts = workload(args, vocab_size=49152)
    assert prompts == workload(args, vocab_size=49152)  # every mode measured gets the same prompts
    assert len(prompts) == 200 and all(len(p) == 1500 + 32 for p in prompts)
    systems = {tuple(p[:1500]) for p in prompts}
    assert len(systems) == 8
    assert len({tuple(p[1500:]) for p in prompts}) == 200


def test_the_distinct_control_shares_no_prefix() -> None:
    args = build_parser().parse_args(["--workload", "distinct", "--requests", "50"])
    prompts = workload(args, vocab_size=49152)
    assert len({tuple(p[:2]) for p in prompts}) == 50  # no two share even their first block


def test_the_table_has_a_row_per_mode() -> None:
    row = {"routing": "prefix", "ttft_ms": {"p50": 120.0, "p90": 300.0}, "failed": 0}
    row |= {"throughput_tok_s": 50.0, "requests_per_s": 3.1, "prefix_cache_hit_rate": 0.9}
    lines = format_table([row, row | {"routing": "least-load"}]).splitlines()
    assert lines[0].split()[:3] == ["routing", "TTFT", "p50"] and len(lines) == 3
    assert lines[1].split()[:3] == ["prefix", "120", "300"]
