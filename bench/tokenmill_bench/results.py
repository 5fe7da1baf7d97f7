"""The results document of a measuring run: its sections (model, server, settings), the peer's figures beside
tokenmill's, and the warnings that make its numbers less trustworthy."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill_bench.arguments import constraint
from tokenmill_bench.load import RequestRecord
from tokenmill_bench.measure import Measured, SideRun
from tokenmill_bench.model import gguf_tensor_bytes, weight_bytes
from tokenmill_bench.report import headline

# Other processes keeping this much of a core busy on average make a level's numbers suspect.
OTHER_LOAD_WARNING_CORES = 0.25
# Below this share of the thread count, the threads' matrix product (machine.core_scaling) says a core was slow.
CORE_SCALING_WARNING_SHARE = 0.75


@dataclass(slots=True)
class Weights:
    """The bytes of weights one decode step reads, and how they were found."""

    total_bytes: int | None
    parameters: int | None
    note: str | None
    model_path: Path | None


@dataclass(slots=True)
class ServerFacts:
    """The server measured: one this run started (``managed``) or one given with --server."""

    address: str
    managed: bool
    args: list[str] | None
    startup_s: float | None
    exit_code: int | None


def weights(
    given: int | None, model_info: dict[str, Any], model_path: Path | None, parameters: int | None, note: str | None
) -> Weights:
    """--weight-bytes, else the server's own count, else the parameters counted here at the served dtype."""
    total: int | None = given
    if total is None and model_info["weight_bytes"]:
        # The server's own count: quantized layers at their stored size, what one step reads.
        total = int(model_info["weight_bytes"])
    elif parameters and model_path is not None:
        # The server names a model after its file (GGUF) or directory: a different name means we counted
        # the wrong checkpoint (e.g. --server without --model), and a wrong bandwidth is worse than none.
        counted_name = model_path.resolve().name if model_path.is_dir() else model_path.name.removesuffix(".gguf")
        if model_info["name"] and counted_name != model_info["name"]:
            note = f"not counted: the server serves {model_info['name']!r}, not {counted_name!r}; pass --model"
            parameters = None
        else:
            try:
                total = weight_bytes(parameters, model_info["dtype"])
            except ValueError as exc:
                note = str(exc)
    return Weights(total, parameters, note, model_path)


def build_result(
    args: argparse.Namespace,
    measured: Measured,
    weights: Weights,
    server: ServerFacts,
    bandwidth: tuple[dict[str, Any], dict[str, Any]],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """Everything but the run's timestamp, duration, the peer's part and the warnings."""
    copy, read = bandwidth
    ours = measured.sides["tokenmill"]
    single, levels = ours.single, ours.levels
    assert single is not None
    single_summary = single.summary()
    level_summaries = [level.summary() for level in levels]
    return {
        **headline(single_summary, level_summaries, weights.total_bytes),
        "copy_bandwidth_gbs": copy["gbs"],
        "read_bandwidth_gbs": read["gbs"],
        **_beside_single(side=ours, weight_bytes=weights.total_bytes),
        "failed_requests": single.failed + sum(level.failed for level in levels if level is not single),
        "bandwidth_convention": "model weight bytes x single-stream decode tok/s (every weight read once per token)",
        "copy_bandwidth": copy,
        "read_bandwidth": read,
        "machine": machine,
        "model": _model_section(measured.model_info, weights),
        "server": {
            "address": server.address,
            "managed": server.managed,
            "args": server.args,
            "startup_s": server.startup_s,
            "exit_code": server.exit_code,
            "rss_max_bytes": max((lv["server_rss_max_bytes"] or 0 for lv in level_summaries), default=0) or None,
        },
        "settings": _settings_section(args),
        "single_stream": single_summary,
        "levels": level_summaries,
        "first_request": _request_row(ours.first_request),
        "long_prompts": ours.long_prompts,
        "peer": None,
    }


def _model_section(model_info: dict[str, Any], weights: Weights) -> dict[str, Any]:
    total, parameters = weights.total_bytes, weights.parameters
    return {
        **model_info,
        "path": str(weights.model_path) if weights.model_path else None,
        "parameters": parameters,
        "bytes_per_parameter": (total // parameters) if parameters and total else None,
        "weight_bytes": total,
        "weight_bytes_note": weights.note,
    }


def _settings_section(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "min_requests": args.min_requests,
        "requests_per_level": {str(c): max(c * args.rounds, args.min_requests) for c in args.concurrency},
        "warmup": args.warmup,
        "shared_prompt": args.shared_prompt,
        "prompt_seed": args.prompt_seed,
        "ramp_s": args.ramp_s,
        "long_prompts": args.long_prompts,
        "long_prompt_seed": args.long_prompt_seed,
        "long_prompt_tries": args.long_prompt_tries,
        "request_timeout_s": args.request_timeout,
        "sampling": "greedy (temperature 0), ignore_eos",
        "constraint": constraint(args),
        "single_stream_from": "the concurrency-1 level",
    }


def run_warnings(result: dict[str, Any]) -> list[str]:
    """Things that make the numbers less trustworthy, said once in the JSON and under the table."""
    warnings = []
    for level in [result["single_stream"], *result["levels"]]:
        other = level.get("other_load_cores")
        if other is not None and other > OTHER_LOAD_WARNING_CORES:
            warnings.append(
                f"concurrency {level['concurrency']}: other processes kept {other:.2f} cores busy on average "
                f"(of {result['machine']['cores']}); its numbers are pessimistic"
            )
    for when, probe in (result["machine"].get("core_scaling") or {}).items():
        if probe and probe["threads"] > 1 and probe["speedup"] < CORE_SCALING_WARNING_SHARE * probe["threads"]:
            busy = ", ".join(
                f"{p['name']} (pid {p['pid']}) {p['cores']:.2f} cores" for p in probe.get("busy_beside", [])
            )
            warnings.append(
                f"at the run's {when}, {probe['threads']} threads multiplied a matrix only {probe['speedup']:.2f} "
                "times as fast as one: a core was slow (held by something else?), and figures that take every "
                "core may be low" + (f"; busy beside it: {busy}" if busy else "")
            )
    restarts = result["model"].get("worker_restarts_after")
    if restarts:
        warnings.append(f"the server's workers restarted {restarts} times during the run")
    peer = result.get("peer") or {}
    if peer.get("failed_requests"):
        warnings.append(f"{peer['failed_requests']} requests to the peer ({peer['name']}) failed; see peer.levels")
    if peer.get("weight_bytes_note"):
        warnings.append(f"peer bandwidth: {peer['weight_bytes_note']}")
    exit_code = result["server"].get("exit_code")
    if exit_code not in (None, 0):
        warnings.append(f"the started server exited with code {exit_code}")
    return list(dict.fromkeys(warnings))


def _request_row(record: RequestRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    from tokenmill_bench.load import request_row

    return request_row(record)


def _peer_weight_bytes(served: Any, model_path: Path | None) -> tuple[int | None, str | None]:
    """The tensor bytes of the GGUF the peer serves (when readable here), or why they are not counted."""
    weight_file = Path(served) if isinstance(served, str) and Path(served).is_file() else model_path
    note = None
    if weight_file is None or weight_file.is_dir():
        weight_file, note = None, "the peer's GGUF is not readable here; bandwidth not counted"
    elif served and Path(served).name != weight_file.name:
        note = f"the peer serves {Path(served).name}, not {weight_file.name}; bandwidth not counted"
        weight_file = None
    peer_weight_bytes = None
    if weight_file is not None:
        try:
            peer_weight_bytes = gguf_tensor_bytes(weight_file)
        except (ImportError, OSError, ValueError) as exc:
            note = f"cannot count the tensor bytes of {weight_file}: {exc}"
    return peer_weight_bytes, note


def peer_section(spec: tuple[str, str], measured: Measured, model_path: Path | None) -> dict[str, Any]:
    """The peer's own figures, in the same shape as tokenmill's, and the bytes it reads per decode step."""
    name, url = spec
    side = measured.sides[name]
    assert side.single is not None
    props = measured.peer_props or {}
    served = props.get("model_path")
    peer_weight_bytes, note = _peer_weight_bytes(served, model_path)
    levels = [level.summary() for level in side.levels]
    return {
        "name": name,
        "url": url,
        "model_path": served,
        "build": props.get("build_info"),
        "total_slots": props.get("total_slots"),
        "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
        "weight_bytes": peer_weight_bytes,
        "weight_bytes_note": note,
        "weight_bytes_convention": "GGUF tensor bytes as stored (llama.cpp computes on the quantized blocks), "
        "a mixture of experts' expert tensors by the share a token chooses",
        "request": "POST /completion: token-id prompt, n_predict, stream, ignore_eos, temperature 0, top_k 1, "
        "cache_prompt true",
        "failed_requests": side.single.failed + sum(level.failed for level in side.levels if level is not side.single),
        "single_stream": side.single.summary(),
        **_beside_single(side=side, weight_bytes=peer_weight_bytes),
        "levels": levels,
        "first_request": _request_row(side.first_request),
        "long_prompts": side.long_prompts,
    }


def _beside_single(side: SideRun, weight_bytes: int | None) -> dict[str, Any]:
    """A side's single-stream bandwidth against the read rate measured right after it."""
    assert side.single is not None
    steps_per_s = side.single.summary()["per_stream_decode_tok_s"] or None
    achieved = weight_bytes * steps_per_s / 1e9 if weight_bytes and steps_per_s else None
    gbs = side.single_read_gbs
    return {
        "read_bandwidth_beside_single_gbs": gbs,
        "read_bandwidth_beside_single_by_method_gbs": side.single_read_by_method_gbs,
        "bandwidth_share_beside_single": achieved / gbs if achieved is not None and gbs else None,
    }


def comparison(result: dict[str, Any]) -> dict[str, Any]:
    """tokenmill against the peer: each level's ratios, the first request, the long prompts."""
    from tokenmill_bench.comparison import compare_first_requests, compare_levels, compare_long_prompts

    peer = result["peer"]
    return {
        "peer": peer["name"],
        "ratio": "tokenmill / peer",
        "read_bandwidth_gbs": result["read_bandwidth_gbs"],
        "weight_bytes": {"tokenmill": result["model"]["weight_bytes"], "peer": peer["weight_bytes"]},
        "single_stream_beside": {
            name: {"read_gbs": side["read_bandwidth_beside_single_gbs"], "share": side["bandwidth_share_beside_single"]}
            for name, side in (("tokenmill", result), ("peer", peer))
        },
        "levels": compare_levels(
            result["levels"],
            peer["levels"],
            weight_bytes=result["model"]["weight_bytes"],
            peer_weight_bytes=peer["weight_bytes"],
            read_gbs=result["read_bandwidth_gbs"],
        ),
        "first_request": compare_first_requests(
            {"tokenmill": result["first_request"], "peer": peer["first_request"]},
            {"tokenmill": result["single_stream"], "peer": peer["single_stream"]},
        ),
        "long_prompts": compare_long_prompts(result["long_prompts"], peer["long_prompts"]),
    }
